"""Wake-ups from the store's own change notifications, so a follower need not poll often.

S3 sends an event for each object written to the queues a bucket's notification
configuration names (``s3:ObjectCreated:*`` to SQS). A follower given such a queue
(``follow(..., notifications=queue_url)``, ``ws follow --notifications URL``) waits on it
between its looks at ``LATEST``: an event naming the folder's ``LATEST`` makes it look at
once, so it can poll rarely (``max_poll``) and still see a version within a request's time.
The looks go on regardless, so a lost event, a queue that fails or one never wired up costs
latency (one ``max_poll`` at most), never a version.

A queue's message goes to one receiver: give each follower its own queue (S3 can notify
several, or fan out through SNS). The messages a follower reads are deleted. The SQS client
is botocore's (installed with s3fs), configured as botocore reads it: credentials and region
from the environment, the endpoint from ``AWS_ENDPOINT_URL_SQS`` or ``AWS_ENDPOINT_URL``. With
no region configured, the one the queue URL names (``https://sqs.eu-west-1.amazonaws.com/…``) is
taken: the queue lives there, and a follower of S3 alone never needed a region to be set.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.parse
from typing import Any

from weightstore.errors import StorageError

_log = logging.getLogger(__name__)

#: longest single wait on the queue, so a follower being stopped is not held long
_LONGEST_WAIT = 1.0
#: the region in an SQS queue URL's host: ``sqs.REGION.amazonaws.com`` (``.cn``; ``….sqs.REGION.vpce…``
#: for a VPC endpoint) or the older ``REGION.queue.amazonaws.com``
_REGION_IN_HOST = re.compile(r"(?:^|\.)sqs(?:-fips)?\.([a-z0-9-]+)\.(?:vpce\.)?amazonaws\.com(?:\.cn)?$"
                             r"|^([a-z0-9-]+)\.queue\.amazonaws\.com(?:\.cn)?$")


class QueueWake:
    """Waits on an SQS queue for an S3 event naming ``key`` (a folder's ``LATEST``)."""

    def __init__(self, queue_url: str, key: str):
        import botocore.exceptions
        import botocore.session

        self.queue_url = queue_url
        self.key = key
        session = botocore.session.get_session()
        region = session.get_config_variable("region") or _region_of(queue_url)
        try:
            self._client: Any = session.create_client("sqs", region_name=region)
        except botocore.exceptions.NoRegionError:
            raise StorageError("no AWS region is configured and the queue URL names none: set AWS_DEFAULT_REGION to "
                               "the queue's region", path=queue_url, transient=False) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise StorageError(f"cannot make an SQS client for this queue ({exc}); check the AWS settings "
                               "(AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_SQS)", path=queue_url, transient=False) from None
        self._failing = False
        self._deletes_failing = False

    def wait(self, seconds: float) -> bool:
        """Up to ``seconds`` (at most a second at a time); True as soon as ``key`` was written."""
        waited = min(seconds, _LONGEST_WAIT)
        started = time.monotonic()
        try:
            answer = self._client.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10,
                                                  WaitTimeSeconds=int(waited))
        except Exception as exc:  # the queue failed: polling goes on without it
            if not self._failing:
                _log.warning("weightstore: notifications from %s failed (%s); polling only", self.queue_url, exc)
            self._failing = True
            time.sleep(max(0.0, waited - (time.monotonic() - started)))
            return False
        self._failing = False
        messages = answer.get("Messages", [])
        if messages:
            try:
                self._client.delete_message_batch(QueueUrl=self.queue_url, Entries=[
                    {"Id": str(i), "ReceiptHandle": message["ReceiptHandle"]} for i, message in enumerate(messages)])
            except Exception as exc:  # undeleted, they come back after the queue's visibility timeout: a look more
                if not self._deletes_failing:
                    _log.warning("weightstore: deleting messages from %s failed (%s)", self.queue_url, exc)
                self._deletes_failing = True
            else:
                self._deletes_failing = False
        if any(self.key in _keys(message.get("Body", "")) for message in messages):
            return True
        time.sleep(max(0.0, waited - (time.monotonic() - started)))  # a sub-second wait is a short poll
        return False


def _region_of(queue_url: str) -> str | None:
    """The AWS region an SQS queue URL's host names; ``None`` for a host that names none (a
    local SQS, a custom endpoint)."""
    match = _REGION_IN_HOST.search(urllib.parse.urlsplit(queue_url).hostname or "")
    return None if match is None else match.group(1) or match.group(2)


def _keys(body: str) -> set[str]:
    """The object keys an S3 event message names (none for a test event or anything else)."""
    try:
        records = json.loads(body).get("Records", [])
        return {urllib.parse.unquote_plus(record["s3"]["object"]["key"]) for record in records}
    except (ValueError, TypeError, KeyError, AttributeError):
        return set()
