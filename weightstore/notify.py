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
from the environment, the endpoint from ``AWS_ENDPOINT_URL_SQS`` or ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from typing import Any

_log = logging.getLogger(__name__)

#: longest single wait on the queue, so a follower being stopped is not held long
_LONGEST_WAIT = 1.0


class QueueWake:
    """Waits on an SQS queue for an S3 event naming ``key`` (a folder's ``LATEST``)."""

    def __init__(self, queue_url: str, key: str):
        import botocore.session

        self.queue_url = queue_url
        self.key = key
        self._client: Any = botocore.session.get_session().create_client("sqs")
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


def _keys(body: str) -> set[str]:
    """The object keys an S3 event message names (none for a test event or anything else)."""
    try:
        records = json.loads(body).get("Records", [])
        return {urllib.parse.unquote_plus(record["s3"]["object"]["key"]) for record in records}
    except (ValueError, TypeError, KeyError, AttributeError):
        return set()
