"""The ``ws`` command: one typer app, one function per command.

Commands stay thin: they parse options, call :mod:`transfer` or :mod:`compare`, and print.
TensorFlow is imported only when a command meets a TF checkpoint, so ``ws ls m.npz`` starts
in a fraction of a second; each command imports its own helpers, so ``ws --help`` and
``ws --version`` import no numpy. Errors of every command, including those :mod:`sync` adds, are
turned into one line and exit status 1 (2 for ``diff`` and ``verify``, whose 1 is an answer)
by :class:`guard.GuardedGroup`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Annotated

import typer

from weightstore._version import __version__
from weightstore.adapters._tf_quiet import silence_tensorflow
from weightstore.cli import render, sync
from weightstore.cli.guard import GuardedGroup, json_asked
from weightstore.cli.render import count, human_bytes, note, settings
from weightstore.core.keys import passes
from weightstore.core.names import TORCH, WRITE_NAMINGS, check_naming, keys_of_torch_names, reads_as_torch, torch_keys
from weightstore.errors import InvalidKeyError, UnsupportedDTypeError, named

if TYPE_CHECKING:
    from weightstore.cli import compare, sources, transfer
    from weightstore.core.manifest import TensorInfo


class _Group(GuardedGroup):
    """The ``ws`` group: its help, and every command's, names values in words, shows flags as flags
    and rewraps each paragraph to the terminal.

    typer labels a value by its Python type (``--include <list[str]>``, ``--scope <str>``)
    and every bool option ``<bool>`` (``--quiet <bool>``), which reads as if it took a value.
    A value without a metavar of its own is named after its option or argument (``--scope
    SCOPE``, ``SOURCE``); a flag's column is left blank. Commands other modules register
    (``cli/sync.py``) and typer's own ``--help`` and completion options are covered too.
    """

    def get_params(self, ctx):
        return _metavars_in_words(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _metavars_in_words(command.get_params(ctx))
            command.help = _unwrapped(command.help)
        return command


def _metavars_in_words(params: list) -> list:
    for param in params:
        if param.metavar is None:
            param.metavar = "" if getattr(param, "is_flag", False) else (param.name or "value").upper()
        if param.param_type_name == "argument":  # named SOURCE already: no "<str>" type column beside it
            param.display_type_rich = _no_type
    return params


def _no_type(ctx: object) -> None:
    return None


def _unwrapped(text: str | None) -> str | None:
    """A docstring's paragraphs each on one line, so help rewraps them to the terminal.

    In rich markup mode typer keeps every line break of a paragraph after the first (and of
    the first in ``ws --help``'s command list), so a docstring wrapped at 100 columns shows as
    ragged half-lines. Paragraphs that start with ``\\b`` (the examples) keep their lines.
    """
    if text is None:
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split("\n")) for p in paragraphs)


app = typer.Typer(
    name="ws",
    cls=_Group,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    help="Move model weights between TensorFlow checkpoints, Keras files and npz, HDF5 or safetensors stores.",
)

Scope = Annotated[str | None, typer.Option("--scope", "-s", help="Scope: on export keep keys under it and strip it; "
                                                                     "on import put every key under it.")]
Include = Annotated[list[str] | None, typer.Option(
    "--include", "-i", metavar="PATTERN", help="Keep keys under this scope or matching this glob (repeatable); relative to --scope.")]
Exclude = Annotated[list[str] | None, typer.Option(
    "--exclude", "-x", metavar="PATTERN", help="Drop keys under this scope or matching this glob (repeatable); relative to --scope.")]


def _check_rules(rules: list[str] | None) -> list[str] | None:
    for rule in rules or []:
        if "=" not in rule:
            raise typer.BadParameter(f"{rule!r} is not of the form FROM=TO")
    return rules


def _kinds(rules: list[str] | None) -> dict[str, str] | None:
    return None if not rules else dict(rule.rsplit("=", 1) for rule in rules)


def _check_names(names: str | None) -> str | None:
    try:
        return check_naming(names, WRITE_NAMINGS)
    except ValueError:
        raise typer.BadParameter(f"{names!r}; use torch or keys") from None


def _check_layout(layout: str | None) -> str | None:
    """An unknown ``--layout`` word is a usage error (exit 2) before any file is opened, like
    any other bad option value."""
    from weightstore.adapters.layout import DIRECTIONS

    if layout is not None and layout not in DIRECTIONS:
        raise typer.BadParameter(f"{layout!r}; use one of {', '.join(DIRECTIONS)}")
    return layout


Compress = Annotated[bool, typer.Option("--compress", help="Deflate the tensors (smaller, not memory-mappable).")]
Shuffle = Annotated[bool, typer.Option("--shuffle", help="Compress npz tensors with byte shuffle + zstd: smaller and "
                                                         "faster to load than --compress, but np.load cannot read them.")]


def _compression(compress: bool, shuffle: bool) -> bool | str:
    """The ``compress=`` the two flags ask for: one way of compressing, so both at once are a
    usage error, where ``--shuffle`` silently won over ``--compress``."""
    if compress and shuffle:
        raise typer.BadParameter("--compress deflates, --shuffle compresses with zstd: give one of them",
                                 param_hint="--shuffle")
    return "shuffle" if shuffle else compress


Names = Annotated[str | None, typer.Option(
    "--names", metavar="torch|keys", callback=_check_names, help="Name the written tensors as PyTorch's state_dict does (torch: "
                                          "features.0.weight; the default for a source named so) or by their keys "
                                          "(keys: features/0/weight).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object (see docs/cli.md).")]
Mapping = Annotated[list[str] | None, typer.Option("--map", "-m", metavar="FROM=TO", callback=_check_rules,
                                                      help="Rename scope FROM to TO, or with */FROM=*/TO (or *) the "
                                                           "end of a key: '*/ExponentialMovingAverage=*' (repeatable; "
                                                           "the first end rule, then the first scope rule a key matches; "
                                                           "applied before --include/--exclude).")]


def _print_version(ctx: typer.Context, wanted: bool) -> None:
    """Eager, so it answers before ``--json`` is parsed: whether that was given is known from the words."""
    if wanted:
        if json_asked(ctx):
            render.emit("version", {"version": __version__})
        else:
            typer.echo(f"weightstore {__version__}")
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print weightstore's version and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or status lines.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and TensorFlow's own logs.")] = False,
    as_json: AsJson = False,
) -> None:
    """Move model weights between TensorFlow checkpoints, Keras files and npz, HDF5 or safetensors stores.

    Global flags may also follow the command: ws ls m.npz -q.
    """
    settings.quiet, settings.debug, settings.json = quiet, debug, as_json
    if not debug:
        silence_tensorflow()


@app.command()
def export(
    source: Annotated[str, typer.Argument(help="TF1/TF2 checkpoint (prefix, one of its files, or its folder), "
                                               "Keras .weights.h5 or .keras file, or a weight store.")],
    output: Annotated[str, typer.Option("--output", "-o", help="The store to write: .npz, .h5 or .safetensors.")],
    scope: Scope = None,
    mapping: Mapping = None,
    include: Include = None,
    exclude: Exclude = None,
    trainable_only: Annotated[bool, typer.Option(
        "--trainable-only", help="Only trainable variables (needs what knows them: a .keras file's own model, "
                                 "a TF1 checkpoint's .meta, or --model or --model-keys).")] = False,
    also: Annotated[list[str] | None, typer.Option(
        "--also", metavar="PATTERN", help="With --trainable-only, also keep keys under this scope or matching this glob (repeatable).",
    )] = None,
    compress: Compress = False,
    shuffle: Shuffle = False,
    model_keys: Annotated[bool, typer.Option(
        "--model-keys", help="Key a .keras SOURCE like its model (dense/kernel, as tf2.export keys it), building "
                             "the model from the archive's config in Keras's safe mode (a .keras of Keras's "
                             "built-in layers is keyed so without it; it is needed for the layers ws's table "
                             "lacks, keras-hub's too, but refuses a class of your own, which no ws process can "
                             "import; --trainable-only implies it, asking the built model which variables "
                             "train).")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", metavar="FILE.keras", help="Key a Keras file or TF2 checkpoint SOURCE like the model of this "
                                              ".keras file (implies --model-keys).")] = None,
    names: Names = None,
    as_json: AsJson = False,
) -> None:
    """Write the weights of SOURCE, or the selected part of them, to a weight store.

    \b
    Example:
      ws export train/ -o model_001.npz --scope tower_0 --exclude '*/Adam*'
      ws export train/ -o small.npz --trainable-only --also '*/bn/moving_*'
      ws export model.keras -o m.npz --model-keys
      ws export model.keras -o small.npz --trainable-only --also '*/moving_*'
      ws export ckpt/ -o m.npz --model model.keras --trainable-only --also '*/bn/moving_*'
    """
    from weightstore.adapters.plan import Selection
    from weightstore.cli import sources, transfer

    _json(as_json)
    compression = _compression(compress, shuffle)
    if also and not trainable_only:
        raise typer.BadParameter("--also adds to what --trainable-only keeps; give --trainable-only too",
                                 param_hint="--also")
    if model_keys and model is None and not source.endswith(".keras"):
        from weightstore.errors import FormatError

        raise FormatError("has no model config to key it by (--model-keys); name a .keras file with --model",
                          path=source)
    # a .keras carries its model, which alone says which variables train: --trainable-only builds it as --model-keys does
    keyed_by = model or (source if model_keys or trainable_only and source.endswith(".keras") else None)
    opening = sources.open_source(source) if keyed_by is None else sources.open_keyed_like_model(source,
                                                                                                         keyed_by)
    with opening as opened:
        selection = Selection(scope=scope, include=include, exclude=exclude, trainable_only=trainable_only, also=also)
        written = transfer.export(opened, output, selection=selection, mapping=mapping,
                                  compress=compression, names=names)
    keyed = f", keyed like the model of {opened.keyed_like}" if opened.keyed_like else ""
    _report("export", written, opened, f"wrote {count(written.count, 'tensor')} ({human_bytes(written.nbytes)}) "
                                       f"from {opened.kind} {opened.path} to {written.path}{keyed}")


@app.command("import")
def import_(
    store: Annotated[str, typer.Argument(help="The weights to import: a store, TF checkpoint or Keras file.")],
    into: Annotated[str, typer.Option("--into", help="Target: a store (.npz, .h5, .safetensors; created or merged into), a TF1 "
                                                     "checkpoint prefix (created or merged into; a new one is "
                                                     "recorded in its folder's 'checkpoint' file) or a TF2 "
                                                     "object-based checkpoint (its variables replaced in place, "
                                                     "keyed as ws ls lists them) or a Keras .weights.h5 or .keras "
                                                     "file (its tensors replaced in place; needs --overwrite).")],
    scope: Scope = None,
    mapping: Mapping = None,
    include: Include = None,
    exclude: Exclude = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace keys the target already holds.")] = False,
    as_json: AsJson = False,
) -> None:
    """Put the weights of STORE into a store or TF checkpoint, under a scope.

    \b
    Example:
      ws import m2.npz --into ensemble.ckpt --scope model_002
      ws export ckpt/ckpt-3 -o fixed.npz    # keyed as ws ls lists them (model/_operations/1/_kernel, ...)
      ws import fixed.npz --into ckpt/ckpt-3 --include 'model/_operations/1/*'   # a key ws ls lists
      ws import fix.npz --into m.weights.h5 --overwrite
    """
    from weightstore.cli import sources, transfer

    _json(as_json)
    with sources.open_source(store) as opened:
        written = transfer.import_(opened, into, scope=scope, mapping=mapping, include=include, exclude=exclude,
                                   overwrite=overwrite)
    _report("import", written, opened, f"wrote {count(written.count, 'tensor')} ({human_bytes(written.nbytes)}) "
                                       f"into {written.kind} {written.path}")


@app.command("ls")
def ls(
    store: Annotated[str, typer.Argument(help="A store, TF checkpoint or Keras file.")],
    scope: Annotated[str | None, typer.Option("--scope", "-s", help="Only keys under this scope, and the key it names itself "
                                                                    "(unless --include is given).")] = None,
    include: Include = None,
    exclude: Exclude = None,
    as_json: AsJson = False,
) -> None:
    """List the tensors of STORE: key, dtype, shape and size, with totals and metadata.

    \b
    Example:
      ws ls model.npz --scope model_002
      ws ls model.npz --include '*/kernel' --exclude 'head/*'
    """
    from weightstore.cli import sources

    _json(as_json)
    with sources.open_source(store) as opened:
        infos = _listable(opened, _under_scope(opened, scope, include, exclude))
        if settings.json:
            render.emit("ls", {
                "path": opened.path, "kind": opened.kind, "created": opened.created, "metadata": opened.metadata,
                "count": len(infos), "nbytes": sum(i.nbytes for i in infos),
                "tensors": [{"key": i.key, "dtype": i.dtype, "shape": list(i.shape), "nbytes": i.nbytes,
                             "checksum": i.checksum} for i in infos],
                "skipped": list(opened.skipped), "keys_note": opened.keys_note,
            })
            return
        _note_skipped(opened)
        if opened.keys_note:
            note(f"keys are the file's own names, not its model's: {opened.keys_note} (ws export --model-keys "
                 "builds the model in Keras to key them, of Keras's and keras-hub's layers; a class of your own: "
                 "tf2.load(model, path) in Python)")
        console = render.stdout()
        console.print(render.printable(f"{opened.path} ({opened.kind})"), soft_wrap=True)  # a line of its own: never folded
        if len(infos) <= render.TABLE_ROWS:
            console.print(render.listing_table(infos))
        else:
            typer.echo("\n".join(render.listing_lines(infos)))
        for name, value in opened.metadata.items():
            console.print(render.printable(f"{name}: {value}"), soft_wrap=True)


def _listable(opened: sources.Source, keys: list[str]) -> list[TensorInfo]:
    """The infos of ``keys``. An entry of a file without a manifest whose dtype no weight has (a
    tool's strings or records beside the weights) joins the skipped entries, as a TF
    checkpoint's string variables do, instead of hiding the rest of the file; it is never read."""
    infos = []
    for key in keys:
        try:
            infos.append(opened.info(key))
        except UnsupportedDTypeError:
            opened.skipped.append(key)
    return infos


def _under_scope(opened: sources.Source, scope: str | None, include: list[str] | None,
                 exclude: list[str] | None) -> list[str]:
    """The keys ``ls`` lists: those under the scope that ``include``/``exclude`` keep, relative to
    the scope, as ``ws export`` and ``ws.load(scope=...)`` select them, and the key the scope names
    itself (TF1's ``w`` beside its slot ``w/Adagrad``), which they leave out (it has no name
    relative to the scope, so no pattern names it), unless ``include`` asks for named keys only.

    A scope or pattern that is invalid or matches nothing fails as ``ws export``'s does: naming
    the file, with the same hint."""
    from weightstore.core.keys import in_scope, normalize_scope, plan_outward, unmatched_scope
    from weightstore.errors import naming

    with naming(path=opened.path):
        norm = normalize_scope(scope)
        keys = [key for key in opened if in_scope(key, norm)]
        if not keys and opened.keys():
            raise unmatched_scope(norm, opened.keys())
        if include or exclude:  # export's own selection, so both commands keep the same keys
            under = [key for key in keys if key != norm]
            if include and keys and not under:  # only the scope's own key, which --include leaves out: export's refusal
                raise unmatched_scope(norm, opened.keys())
            kept = set(plan_outward(under, scope=norm, include=include, exclude=exclude).values()) if under else set()
            keys = [key for key in keys if key in kept or (key == norm and not include)]
    return keys


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="A store, TF checkpoint or Keras file.")],
    b: Annotated[str, typer.Argument(help="Another one, compared key by key.")],
    atol: Annotated[float, typer.Option(min=0.0, help="Values differing by at most this count as equal.")] = 0.0,
    read: Annotated[bool, typer.Option("--read", help="Read every pair, also those whose recorded content digests "
                                                      "agree (and check each tensor's checksum as it is read).")] = False,
    as_json: AsJson = False,
) -> None:
    """Compare the tensors of A and B: added, removed, changed (with the fraction of elements changed) and unchanged.

    Exit status 0 when the tensors are equal, 1 when they differ (metadata is shown, not judged),
    2 when they cannot be compared (a file missing or corrupt), as diff and cmp exit.
    Pairs whose content digests, as their writers recorded them, agree are not read: a copy
    damaged since reads as unchanged unless --read (ws verify checks a file alone).
    A state_dict file keyed 3.bias (saved before ws.save read such names as keys) is
    compared with one read as 3/bias by 3/bias.

    \b
    Example:
      ws diff before.npz after.npz --atol 1e-6
    """
    from weightstore.cli import compare, sources

    _json(as_json)
    with contextlib.ExitStack() as opened:
        left, right = (opened.enter_context(sources.open_source(path)) for path in (a, b))
        # a state_dict saved before its names were read as keys, against one saved since: by keys alike
        left, right = (opened.enter_context(sources.open_source(path, TORCH)) if _state_dict_of_old(mine, other)
                       else mine for path, mine, other in ((a, left, right), (b, right, left)))
        result = compare.diff(left, right, atol=atol, read=read)
    if settings.json:
        render.emit("diff", {"a": a, "b": b, "atol": atol, **result.to_json()})
    else:
        _print_diff(a, b, result)
    if not result.equal:
        raise typer.Exit(1)


def _state_dict_of_old(store: sources.Source, other: sources.Source) -> bool:
    """Whether ``store`` holds a ``state_dict``'s names as its keys (``features.0.weight``: saved
    before ``ws.save`` read them as keys, or by ``np.savez``) and ``other`` holds them as names
    read by keys (``features/0/weight``): compared as they are, every tensor reads as removed and
    added. Names that make no key (``a..b``) are compared as they are."""
    from weightstore.cli import transfer

    if store.stored_names() or not reads_as_torch(store.keys()) or transfer.naming_of(other) != TORCH:
        return False
    try:
        keys_of_torch_names(store.keys())
    except InvalidKeyError:
        return False
    return True


def _percent(fraction: float | None) -> str:
    return "?" if fraction is None else f"{100 * fraction:.3g}%"


def _print_diff(a: str, b: str, result: compare.Diff) -> None:
    echo = typer.echo
    for key in result.removed:
        echo(f"- {key}")
    for key in result.added:
        echo(f"+ {key}")
    for change in result.changed:
        if change.reason == "values":
            echo(f"~ {change.key}  max abs {change.max_abs:.6g}  max rel {change.max_rel:.6g}  "
                 f"{_percent(change.changed_fraction)} of elements changed")
        else:
            echo(f"~ {change.key}  {change.reason}: {change.a} -> {change.b}")
    by_digest = f" ({result.by_digest} by their recorded digests, not read; --read reads them)" if result.by_digest else ""
    echo(f"{a} vs {b}: {len(result.added)} added, {len(result.removed)} removed, {len(result.changed)} changed, "
         f"{result.unchanged} unchanged{by_digest}" + ("" if result.metadata_equal else "; metadata differs"))


@app.command()
def convert(
    a: Annotated[str, typer.Argument(help="The weights to convert: a store, TF checkpoint or Keras file.")],
    b: Annotated[str, typer.Argument(help="The store to write; its suffix picks npz, HDF5 (.h5) or .safetensors.")],
    compress: Compress = False,
    shuffle: Shuffle = False,
    as_json: AsJson = False,
    layout: Annotated[str | None, typer.Option(
        "--layout", callback=_check_layout, help="Convert names and layouts: keras-to-torch, torch-to-keras, keras-to-flax, flax-to-keras.",
    )] = None,
    names: Annotated[str | None, typer.Option(
        "--names", metavar="torch|keys", callback=_check_names, help="Name the written tensors as PyTorch's state_dict does (torch: "
                                              "features.0.weight; the default with --layout keras-to-torch, and "
                                              "without --layout for a source named so) or by their keys (keys: "
                                              "features/0/weight).")] = None,
    kind: Annotated[list[str] | None, typer.Option(
        "--kind", metavar="SCOPE=KIND", callback=_check_rules,
        help="With --layout: the kind (dense, conv, depthwise, norm, embedding) of the layers under SCOPE (a scope "
             "or glob), where the file's names and shapes do not tell (repeatable); into Keras, depthwise:M for a "
             "depth multiplier M, attention:HEADS for a PyTorch MultiheadAttention.")] = None,
    max_shard_size: Annotated[str | None, typer.Option(
        "--max-shard-size", metavar="SIZE", help="Write B as a Hugging Face sharded folder: safetensors shards of at "
                                                 "most SIZE bytes (5GB, 500MiB) and model.safetensors.index.json.",
    )] = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar="FILE.keras", help="Key a Keras file or TF2 checkpoint A like the model of this .keras "
                                              "file first (without it, a .keras A with a keras-to-* layout is keyed "
                                              "by its own model).")] = None,
) -> None:
    """Rewrite A as B in another format (npz, HDF5, safetensors), compression or layout; metadata is kept.

    \b
    Example:
      ws convert model.npz model.h5
      ws convert model.keras torch.safetensors --layout keras-to-torch
      ws convert model.weights.h5 torch.safetensors --layout keras-to-torch --model model.keras
      ws convert torch.safetensors keras.npz --layout torch-to-keras
      ws convert model.npz hf-folder/ --max-shard-size 5GB
    """
    from weightstore.cli import sources, transfer

    _json(as_json)
    compression = _compression(compress, shuffle)
    from_keras = bool(layout and layout.startswith("keras-to-"))
    if kind and not layout:
        raise typer.BadParameter("says how --layout converts a layer's tensors; without --layout nothing is converted",
                                 param_hint="--kind")
    if model and layout and not from_keras:
        raise typer.BadParameter(f"keys A like a Keras model, which --layout {layout} does not read; leave it out",
                                 param_hint="--model")
    keyed_by = model or (a if from_keras and a.endswith(".keras") else None)
    if keyed_by is None and from_keras and a.endswith(".weights.h5"):
        from weightstore.errors import FormatError

        raise FormatError("names its tensors as Keras's save walk does (layers/dense/vars/0), which says no layer's kind "
                          "or variable; a layout needs them: give the model it was saved from, --model model.keras "
                          "(or convert that .keras file itself)", path=a)
    opening = sources.open_source(a) if keyed_by is None else sources.open_keyed_like_model(a, keyed_by)
    with opening as opened:
        given = _kinds(kind) or {}  # first: the first pattern matching a layer decides, and the user's say wins
        keys = torch_keys(opened.keys()) if layout == "torch-to-keras" else opened.keys()  # as convert reads them
        scopes = {key.rpartition("/")[0] for key in keys}
        unused = [pattern for pattern in given if not any(passes(scope, include=pattern) for scope in scopes)]
        if unused:  # a typo would leave the layer it was written for to be guessed
            raise typer.BadParameter(f"{unused[0]!r} matches no layer of {a} (its layers: "
                                     f"{named(sorted(scopes))})", param_hint="--kind")
        kinds = {**given, **{scope: k for scope, k in opened.kinds.items() if scope not in given}}
        written = transfer.convert(opened, b, compress=compression, layout=layout, names=names,
                                     max_shard_size=max_shard_size, kinds=kinds)
    _report("convert", written, opened, f"wrote {count(written.count, 'tensor')} ({human_bytes(written.nbytes)}) "
                                        f"to {written.path}")


@app.command()
def verify(store: Annotated[str, typer.Argument(help="The weight store, or folder of ws.publish versions, to check.")],
           as_json: AsJson = False) -> None:
    """Check the structure of STORE and every tensor's checksum; exit 1 naming what is corrupt.

    STORE may be a folder of ws.publish versions (local or s3://): every version ws versions
    lists is checked, one line each as it is done (ok, corrupt, or skipped: above LATEST, being
    written by a publish under way, or pruned meanwhile); a delta is rebuilt (each delta of a
    chain opened and applied once, onto the version before) and checked against its recorded
    digests, so a damaged anchor fails every delta built on it, each line naming the anchor. A
    version's name held by a link, a folder or a FIFO is corrupt, never opened.

    Exit status 0 when it is intact, 1 when it is corrupt (any version) or no weight file, 2 when
    it cannot be checked (no such file, an empty folder, a storage outage).

    \b
    Examples:
      ws verify model.npz
      ws verify s3://bucket/run
    """
    import weightstore
    from weightstore.cli import compare
    from weightstore.errors import ChecksumError, StoreNotFoundError
    from weightstore.formats import tf_checkpoint

    _json(as_json)
    try:
        opening = weightstore.open(store)
    except StoreNotFoundError:
        if not compare.holds_versions(store):
            if tf_checkpoint.is_empty_folder(store):  # a run not yet published to: said as verify sees it
                raise StoreNotFoundError("is an empty folder: no weight file, and no ws.publish versions to verify",
                                         path=store) from None
            raise
        _verify_folder(store)
        return
    with opening as opened:
        problems = compare.verify(opened)
        total, has_checksums, by_tf = len(opened), opened.has_checksums, opened.format == tf_checkpoint.FORMAT.name
    if settings.json and not problems:
        render.emit("verify", {"path": store, "count": total, "checksums": has_checksums or by_tf, "problems": []})
        return
    if len(problems) == 1:
        raise ChecksumError(f"{problems[0].message} (1 of {count(total, 'tensor')} corrupt)", path=store,
                            key=problems[0].key)
    if problems:
        raise ChecksumError(f"{len(problems)} of {count(total, 'tensor')} corrupt: {compare.said_once(problems)}",
                            path=store, keys=[problem.key for problem in problems])
    if has_checksums:
        note(f"{store}: ok, {count(total, 'tensor')}, checksums match")
    elif by_tf:  # no manifest, but every tensor read was checked against the CRC-32C TF's index records
        note(f"{store}: ok, {count(total, 'tensor')}, TF's CRC-32C checksums match")
    else:
        note(f"{store}: readable, {count(total, 'tensor')}; no weightstore manifest, so no checksums to check")


def _verify_folder(folder: str) -> None:
    """``ws verify FOLDER``: a line per version on stdout (with ``--json``, one object listing
    them), then exit 1 naming every corrupt version (a damaged ``LATEST`` too), else 0."""
    from weightstore.cli import compare
    from weightstore.cli.guard import describe
    from weightstore.errors import FormatError, StoreNotFoundError

    def said(check: compare.VersionCheck) -> None:  # a line as each version is done: a long folder shows progress
        found = check.fault or compare.said_once(check.problems) or f"{count(check.count, 'tensor')}"
        typer.echo(render.printable(f"{check.path}: {check.state} ({check.kind}): {found}"))

    checks, damage = compare.verify_versions(folder, None if settings.json else said)
    if not checks and damage is None:  # nothing to tell intact from lost
        raise StoreNotFoundError("holds no versions to verify (ws versions lists none)", path=folder)
    corrupt = [check for check in checks if check.state == "corrupt"]
    failure = None
    if corrupt or damage is not None:
        found = [f"{len(corrupt)} of {count(len(checks), 'version')} corrupt: "
                 f"{named([check.path.rsplit('/', 1)[-1] for check in corrupt], shown=5)}"] if corrupt else []
        failure = FormatError("; ".join(found + ([damage.message] if damage is not None else [])), path=folder)
    if settings.json:
        document = {"command": "verify", "ok": failure is None, "folder": folder, "versions": [
            {"step": check.step, "path": check.path, "kind": check.kind, "state": check.state, "count": check.count,
             "problems": [{"key": problem.key, "message": problem.message} for problem in check.problems],
             "fault": check.fault} for check in checks], "latest_error": None if damage is None else str(damage)}
        if failure is not None:
            document["error"] = render.error_document("verify", failure, describe(failure))["error"]
        render.print_json(document)
    elif damage is not None:
        typer.echo(render.printable(f"{damage.path}: corrupt: {damage.message}"))
    if failure is not None:
        typer.echo(f"error: {describe(failure)}", err=True)
        raise typer.Exit(1)


def _json(as_json: bool) -> None:
    """``--json`` after the command means what it means before it."""
    settings.json = settings.json or as_json


def _report(command: str, written: transfer.Written, source: sources.Source, line: str) -> None:
    """What a writing command did: one JSON object with ``--json``, else a note on stderr."""
    if settings.json:
        render.emit(command, {"source": source.path, "source_kind": source.kind, "path": written.path,
                              "kind": written.kind, "count": written.count, "nbytes": written.nbytes,
                              "skipped": list(source.skipped), "keyed_like": source.keyed_like,
                              "caution": written.caution})
        return
    note(line)
    if written.caution:
        note(written.caution)
    _note_skipped(source)


def _note_skipped(source: sources.Source) -> None:
    if source.skipped:
        note(f"skipped {len(source.skipped)} entr{'y' if len(source.skipped) == 1 else 'ies'} of no plain array "
             f"(text, or TF's quantized types): {named(source.skipped, shown=5)}")


sync.register(app)


def main() -> None:
    """The console script ``ws``."""
    app(prog_name="ws")
