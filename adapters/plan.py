"""What an assign will do, decided before any variable changes: values paired with targets.

Adapters differ only in how they list variables and write values; what an assign means is
decided here and in the modules beside it, the same for every adapter: the words
(:mod:`~weightstore.adapters._options`), the values' view (:mod:`~weightstore.adapters._values`),
the dtype rules (:mod:`~weightstore.adapters._casts`), the report
(:mod:`~weightstore.adapters._report`), a refusal's wording (:mod:`~weightstore.adapters._wording`)
and hot reload's memory (:mod:`~weightstore.adapters._reload`).
:mod:`weightstore.adapters.skeleton` runs the plan. The report and the words are public here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from weightstore.adapters import _tf1_training
from weightstore.adapters._casts import describe
from weightstore.adapters._options import AssignOptions, AssignWords, Selection, SelectionWords, keeps, require_also_use
from weightstore.adapters._report import AssignWarning, Mismatch, Plan, Report, TargetInfo
from weightstore.adapters._values import ValueSource
from weightstore.adapters._wording import assign_message, few_assigned, no_such_scope, pair_problem
from weightstore.core.keys import (
    MappingRules,
    ends_by_rule,
    in_scope,
    join_scope,
    map_key,
    normalize_scope,
    parse_mapping,
    passes,
    plan_inward,
    require_matches,
    strip_scope,
)
from weightstore.errors import AssignmentError, SelectionError, WeightStoreError, named, naming

__all__ = ["Report", "SelectionWords", "AssignWords", "Selection", "AssignOptions", "AssignWarning"]

OPTIMIZER_SCOPE = "optimizer"  # a Keras model's optimizer state, as tf2.export(optimizer=True) and a .keras key it
INNER_OPTIMIZER = "inner_optimizer"  # the optimizer a LossScaleOptimizer wraps (mixed precision), saved again below it
OPTIMIZER_KEY = re.compile(rf"{OPTIMIZER_SCOPE}/(?:{INNER_OPTIMIZER}/)?vars/\d+")
#: a Keras optimizer's variable under any scope (``model_001/optimizer/vars/0``: a ``.keras`` imported by scope)
OPTIMIZER_STATE = re.compile(rf"(?:^|/){OPTIMIZER_KEY.pattern}$")


def training_state(keys: Collection[str], targets: Collection[str], scope: str | None,
                   mapping: MappingRules = None) -> list[str]:
    """The value ``keys`` that are training state and name no variable of ``targets`` under
    ``scope``: a Keras model's optimizer state (``optimizer/vars/<i>``, as a ``.keras`` of a
    model trained after ``compile`` holds it, under any scope: an ensemble's store of such files
    imported by scope holds ``model_001/optimizer/vars/<i>``) and a TF1 ``Saver`` checkpoint's, as TF names it
    (``w/Adam``, ``beta1_power``, ``global_step``: :func:`_tf1_training.by_naming`). Every
    assign leaves them out (``plan_assign``'s ``left_out``) unless the adapter is asked for
    them (``optimizer=True``), so such a file goes into any model, module or graph of its layers.
    A key a ``*/END`` rule of ``mapping`` renames is asked for by name, so never left out: the
    EMA shadow ``w/ExponentialMovingAverage`` that ``*/ExponentialMovingAverage=*`` reads as ``w``."""
    norm_scope, rules = normalize_scope(scope), parse_mapping(mapping)
    keys = list(keys)
    state = _tf1_training.by_naming(keys)
    return [key for key in keys if (key in state or OPTIMIZER_STATE.search(key))
            and join_scope(norm_scope, key) not in targets and not ends_by_rule(key, rules)]


def plan_assign(
    values: ValueSource,
    targets: Mapping[str, TargetInfo],
    options: AssignOptions,
    *,
    optional: Callable[[str], bool] | None = None,
    refused: Sequence[Mismatch] = (),
    left_out: Collection[str] = (),
    tied: Mapping[str, str] | None = None,
) -> Plan:
    """Pair values with variables by key and check every pair; raise before writing if strict.

    Values are the dictionary's keys after ``mapping`` and ``scope`` that pass
    ``include``/``exclude`` (scope-relative). Targets are the variables under ``scope`` whose
    scope-relative key passes the same selection, and, with ``trainable_only``, are trainable
    or match ``also``. Not strict, a plan that leaves most targets as they were carries a
    warning (:attr:`Plan.warning`, issued by :meth:`Plan.warn` once the assign succeeded):
    that is nearly always the wrong file, scope or mapping.
    ``optional`` keys are state one framework keeps and others lack (PyTorch's
    ``num_batches_tracked``): assigned when both sides have them, never missing or unexpected.
    ``refused`` are values the adapter could not offer at all (no layout rule converts them);
    they count as mismatched. ``left_out`` are value keys (as the values name them) that are
    training state the caller did not ask for (a TF1 checkpoint's optimizer slots): never
    paired, listed in ``report.left_out``. ``tied`` maps a target to the first of the targets
    that are one tensor with it (PyTorch's tied weights): a value for any of them is a value
    for all, so a file that holds one of them (as ``safetensors.torch.save_model`` and Hugging
    Face write tied weights) leaves none missing.
    """
    norm_scope = normalize_scope(options.scope)
    include, exclude, cast = options.include, options.exclude, options.cast
    every_key = values.keys()
    described = "" if values.path else values.where  # a file is the errors' path, not in their text
    with naming(path=values.path):
        try:
            value_keys = plan_inward([key for key in every_key if key not in left_out] if left_out else every_key,
                                     scope=norm_scope, mapping=options.mapping, include=include, exclude=exclude,
                                     where=described)
        except SelectionError as error:
            raise _naming_left_out(error, every_key, left_out, options, described) from None
    selectable = {
        strip_scope(key, norm_scope): info
        for key, info in targets.items()
        if in_scope(key, norm_scope) and key != norm_scope and passes(strip_scope(key, norm_scope), include, exclude)
    }
    if options.also:
        require_also_use(options.trainable_only)
        require_matches(selectable.keys(), options.also, "also", "the model's variables")
    chosen = {join_scope(norm_scope, relative): info for relative, info in selectable.items()
              if keeps(relative, info.trainable, options.trainable_only, options.also)}
    report = Report(left_out=[key for key in every_key if key in left_out] if left_out else [])
    tied = tied or {}
    valued_groups = {tied.get(key, key) for key in value_keys if key in chosen}
    report.missing = [k for k in chosen if k not in value_keys and not (optional and optional(k))
                      and tied.get(k, k) not in valued_groups]
    report.unexpected = [k for k in value_keys if k not in chosen and not (optional and optional(k))]
    report.mismatched.extend(refused)
    pairs: dict[str, str] = {}
    for key, source in value_keys.items():
        target = chosen.get(key)
        if target is None:
            continue
        problem = pair_problem(values.dtype(source), values.shape(source), target, cast)
        if problem:
            report.mismatched.append(
                Mismatch(key, describe(target.dtype, target.shape), describe(values.dtype(source), values.shape(source)), problem)
            )
        else:
            pairs[key] = source
    renamed = bool(options.scope or options.mapping)  # value keys are as the caller's words made them
    if (options.strict and not report.ok) or not pairs:
        empty = norm_scope and not any(in_scope(key, norm_scope) and key != norm_scope for key in targets)
        raise AssignmentError(
            assign_message(report, described, chosen, value_keys, pairs, targets, lambda key: values.shape(value_keys[key]),
                     trainable_only=options.trainable_only, hints=not values.exact_keys,
                     note=getattr(values, "missing_note", ""), renamed=renamed,
                     scope_problem=no_such_scope(norm_scope, targets, value_keys) if empty else ""),
            missing=report.missing, unexpected=report.unexpected, mismatched=report.mismatched, path=values.path,
        )
    required = {key: info for key, info in chosen.items() if not (optional and optional(key) and key not in pairs)}
    warning = (few_assigned(values.where, len(pairs), required, value_keys, renamed, report.mismatched)
               if len(pairs) * 2 < len(required)
               else "")
    return Plan(pairs, report, warning)


def settle_tied(plan: Plan, values: ValueSource, targets: Mapping[str, TargetInfo], tied: Mapping[str, str], *,
                strict: bool) -> None:
    """Keys that name one variable (``tied``, as :func:`plan_assign` takes it: a dict naming a
    variable twice, a wrapped optimizer's slots that Keras files name twice) are written once.
    Where several of them have a value, the values must be one value, or whichever came last
    would win for all: equal ones are written under the first key alone, and a different one
    is mismatched (strict: refused, nothing changed). Equal means the same bytes once cast to
    the target's dtype; content digests decide without a read where both values have one."""
    if not tied:
        return
    groups: dict[str, list[str]] = {}
    for key in plan.pairs:
        groups.setdefault(tied.get(key, key), []).append(key)
    conflicts = []
    for first, *others in (keys for keys in groups.values() if len(keys) > 1):
        for key in others:
            source = plan.pairs.pop(key)
            if not _same_value(values, plan.pairs[first], source, targets[key].dtype):
                shape = describe(values.dtype(source), values.shape(source))
                conflicts.append(Mismatch(key, describe(targets[key].dtype, targets[key].shape), shape,
                                          f"the same variable as {first!r}, whose value differs"))
    refuse_before_write(conflicts, plan.report, strict=strict, where="" if values.path else values.where,
                        path=values.path)


def _same_value(values: ValueSource, one: str, other: str, dtype: np.dtype) -> bool:
    if tuple(values.shape(one)) != tuple(values.shape(other)):
        return False
    digests = values.checksum(one), values.checksum(other)
    if None not in digests and (digests[0] == digests[1] or values.dtype(one) == values.dtype(other)):
        return digests[0] == digests[1]  # else two dtypes: equal once cast, maybe
    with np.errstate(all="ignore"):  # a value beyond the dtype is refused later, by the range check
        read = [np.ascontiguousarray(values.read(key), dtype) for key in (one, other)]
    return bool(np.array_equal(read[0].reshape(-1).view(np.uint8), read[1].reshape(-1).view(np.uint8)))


def refuse_before_write(conflicts: Sequence[Mismatch], report: Report, *, strict: bool, where: str,
                        path: str | None = None) -> None:
    """Mismatches found after planning, before any write: strict, an :class:`AssignmentError`
    that changes nothing; else listed in ``report.mismatched``, the rest written."""
    if conflicts and strict:
        lines = "\n".join(f"    {mismatch}" for mismatch in conflicts)
        on = f" {where}" if where else ""
        raise AssignmentError(f"cannot assign{on}: nothing was changed\n  {len(conflicts)} mismatched:\n{lines}",
                              mismatched=list(conflicts), path=path)
    report.mismatched.extend(conflicts)


def _naming_left_out(error: SelectionError, keys: Collection[str], left_out: Collection[str],
                     options: AssignOptions, where: str) -> SelectionError:
    """``error`` (a mapping rule or ``include`` word that fits none of the values) retold where
    the word fits only training state this assign leaves out: "matches no key" of a slot the
    file holds (``w/ExponentialMovingAverage``) sent the user looking for a typo."""
    if not left_out or error.word is None:
        return error
    try:
        plan_inward(keys, scope=options.scope, mapping=options.mapping, include=options.include,
                    exclude=options.exclude, where=where)
    except SelectionError:
        return error  # some word fits no key, training state or not
    except WeightStoreError:
        pass  # the words fit; what they then do wrong is for optimizer=True's assign to say
    rules = parse_mapping(options.mapping)
    state = [key for key in left_out if any(in_scope(key, source) for source, _ in rules)
             or (options.include is not None and passes(map_key(key, rules), options.include))]
    return SelectionError(f"{error.word} names only training state, which an assign leaves out (tf1 and tf2 "
                          f"assign it with optimizer=True): {named(state)}") if state else error
