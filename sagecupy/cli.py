"""The ``sagecupy`` command line: a thin click layer over :mod:`sagecupy.analysis`.

Commands: ``info``, ``accuracy`` (the σ-sweep of docs/algorithms.md §7.1), ``intermediates`` and
``smoothing`` (the ablation); ``bench``, ``plot`` and ``warmup`` (kernel compiles ahead of use).
Every analysis command shares the options of :func:`analysis_options`, resolves the backend with
:func:`_prepare`, runs an :mod:`sagecupy.analysis` function under a stderr progress bar and writes the
records with :func:`emit` (``table``, ``json`` lines or ``csv``, to stdout or
``--out``). A new command (``bench``, ``plot``) follows the same pattern.

Errors a user can cause (a bad option value, a missing file, ``--backend gpu``
on a machine without a device) end in one ``Error: ...`` line on stderr and
exit status 1 (2 for a malformed command line), never a traceback;
``SAGECUPY_DEBUG=1`` shows the traceback behind a library error.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass

import click

from . import __version__, analysis
from ._loader import gpu_status

__all__ = ["main", "emit", "format_table", "analysis_options"]

FORMATS = ("table", "json", "csv")


# ----------------------------------------------------------------------------
# one-line errors
# ----------------------------------------------------------------------------


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class _Group(click.Group):
    """A click group whose errors are one line on stderr (no usage block, no traceback)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            click.echo(f"Error: {_one_line(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"Error: {_one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # `sagecupy accuracy | head`
                sys.exit(1)
            raise
        sys.exit(0)


#: Set to 1 to see the traceback behind a one-line error (for bugs, not for bad arguments).
DEBUG_ENV = "SAGECUPY_DEBUG"


@contextlib.contextmanager
def _library_errors():
    """Turn the library's argument errors (ValueError / TypeError) into one-line click errors.

    With the environment variable ``SAGECUPY_DEBUG=1`` they propagate with their traceback.
    """
    try:
        yield
    except (ValueError, TypeError) as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        raise click.ClickException(_one_line(str(exc))) from None


# ----------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------


def _fmt_value(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.6f}" if 0.01 <= abs(value) < 10 else f"{value:.3e}"
    return "-" if value is None else str(value)


def _fmt_cos(value) -> str:
    return f"{value:.6f}" if isinstance(value, float) and math.isfinite(value) else _fmt_value(value)


def _fmt_sigma(value) -> str:
    return f"{value:g}"


# The columns of each record type in a table: (key, label, formatter).
_COLUMNS = {
    "accuracy": [("sigma", "sigma", _fmt_sigma), ("tensor", "tensor", str), ("cos", "cos", _fmt_cos),
                 ("rel_l2", "rel_l2", _fmt_value), ("rel_l1", "rel_l1", _fmt_value), ("rmse", "rmse", _fmt_value)],
    "smoothing": [("smoothing", "smoothing", str), ("sigma", "sigma", _fmt_sigma), ("tensor", "tensor", str),
                  ("cos", "cos", _fmt_cos), ("rel_l2", "rel_l2", _fmt_value), ("rel_l1", "rel_l1", _fmt_value),
                  ("rmse", "rmse", _fmt_value)],
    "intermediate": [("tensor", "tensor", str), ("source", "source", str), ("cos", "cos", _fmt_cos),
                     ("rel_l2", "rel_l2", _fmt_value), ("rel_l1", "rel_l1", _fmt_value),
                     ("rms", "rms", _fmt_value), ("rms_exact", "rms exact", _fmt_value)],
    "ds_bound": [("tensor", "tensor", str), ("ds_row_rms_mean", "row RMS mean", _fmt_value),
                 ("ds_row_rms_max", "row RMS max", _fmt_value), ("bound_mean", "bound mean", _fmt_value),
                 ("bound_max", "bound max", _fmt_value), ("tightness_mean", "RMS/bound mean", _fmt_value),
                 ("bound_holds", "holds", _fmt_value), ("dp_rms", "RMS dP", _fmt_value)],
}

_TITLES = {
    "ds_bound": "dS RMS bound (docs/algorithms.md §4.5), exact computation, per row: "
                "RMS(dS_i) <= max_j |dP_ij - delta_i| / sqrt(n_i)",
}


def format_table(rows: list[dict], columns) -> str:
    """An aligned plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[fmt(row.get(key)) for key, _, fmt in columns] for row in rows]
    labels = [label for _, label, _ in columns]
    widths = [max([len(label)] + [len(r[i]) for r in cells]) for i, label in enumerate(labels)]
    numeric = [all(_looks_numeric(r[i]) for r in cells) for i in range(len(labels))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(labels), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _describe(head: dict) -> list[str]:
    """The table format's header lines: what was run, where, on what."""
    shape = f"B={head['batch']} H={head['heads']}"
    if head["heads_kv"] != head["heads"]:
        shape += f" Hkv={head['heads_kv']}"
    shape += f" N={head['n_q']}" if head["n_q"] == head["n_k"] else f" Nq={head['n_q']} Nk={head['n_k']}"
    shape += f" D={head['d']}"
    lines = [
        f"# sagecupy {head['command']}: family {head['family']}, config {head['config']}, "
        f"backend {head['backend']}",
        f"# shape {shape} ({head['layout']}), dtype {head['dtype']}, causal {str(head['causal']).lower()}, "
        f"seed {head['seed']}, sm_scale 1/sqrt(D)"
        + (f", sigma {head['sigma']:g}" if head.get("sigma") is not None else ""),
        f"# inputs {head['inputs']}; errors vs float64 exact attention on the same {head['dtype']}-rounded inputs",
        f"# gpu {head['gpu'] or 'none'}; sagecupy {head['sagecupy']}"
        + (f" ({head['git_commit'][:12]})" if head.get("git_commit") else ""),
    ]
    return lines


def _json_safe(value):
    """Non-finite floats as the strings 'nan' / 'inf' / '-inf' (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def render(records: list[dict], head: dict, fmt: str) -> str:
    """The text of ``records`` in ``fmt`` (see :func:`emit`)."""
    if fmt == "json":
        lines = [json.dumps(_json_safe(head), allow_nan=False)]
        lines += [json.dumps(_json_safe(rec), allow_nan=False) for rec in records]
        return "\n".join(lines) + "\n"
    if fmt == "csv":
        fields = []
        for rec in records:
            fields += [key for key in rec if key not in fields]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for rec in records:
            writer.writerow(rec)
        return buf.getvalue()
    blocks = ["\n".join(_describe(head))]
    for kind in _COLUMNS:
        rows = [rec for rec in records if rec.get("type") == kind]
        if rows:
            title = _TITLES.get(kind)
            blocks.append((f"{title}\n" if title else "") + format_table(rows, _COLUMNS[kind]))
    return "\n\n".join(blocks) + "\n"


def emit(records: list[dict], head: dict, fmt: str, out) -> None:
    """Write ``records`` with the environment header ``head``.

    ``table``: header lines starting with ``#``, then aligned tables.
    ``json``: JSON lines, the header object (``"type": "env"``) first, then one
    object per record. ``csv``: a header row and one row per record (the
    environment is not in the CSV; use JSON to keep it).
    ``out``: a path, or ``None`` for stdout.
    """
    text = render(records, head, fmt)
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        with open(out, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(f"sagecupy: wrote {len(records)} records to {out}", err=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def _progress(steps: list[str], label: str):
    """Progress on stderr while ``len(steps)`` steps run; yields ``step(n)``, called after each ``n`` steps.

    On a terminal a click progress bar. Elsewhere (a log file, a pipe, CI) click's bar prints only its label,
    so each finished step gets a line instead: ``sagecupy: sigma 3 done (2/5, 31 s)``.
    """
    stream = sys.stderr
    if _isatty(stream):
        with click.progressbar(length=len(steps), label=label, file=stream, show_eta=True) as bar:
            yield bar.update
        return
    start, done = time.monotonic(), 0

    def step(n: int = 1) -> None:
        nonlocal done
        for _ in range(n):
            done += 1
            what = steps[done - 1] if done <= len(steps) else label
            click.echo(f"sagecupy: {what} done ({done}/{len(steps)}, {time.monotonic() - start:.0f} s)", err=True)

    yield step


# ----------------------------------------------------------------------------
# shared options
# ----------------------------------------------------------------------------


def _parse_sigmas(ctx, param, value):
    if value is None:
        return analysis.SIGMAS
    try:
        sigmas = tuple(float(s) for s in value.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers, e.g. 1,3,5") from None
    if not sigmas or not all(math.isfinite(s) and s > 0 for s in sigmas):
        raise click.BadParameter(f"{value!r}: every sigma must be a positive finite number")
    return sigmas


_POSITIVE = click.IntRange(min=1)


def _config_help() -> str:
    """``--config``'s help: the configs each family takes, from :data:`analysis.FAMILY_CONFIGS`."""
    parts = []
    for fam, names in analysis.FAMILY_CONFIGS.items():
        described = [f"{name} ({analysis.CONFIG_HELP[fam, name]})" if (fam, name) in analysis.CONFIG_HELP else name
                     for name in names]
        parts.append(f"{fam}: {' | '.join(described)}")
    return "Named config of --family. " + "; ".join(parts) + "."


def analysis_options(*, sigmas: bool = False, sigma: bool = False, load: bool = False):
    """The options every analysis command takes (plus ``--sigmas`` / ``--sigma`` / ``--load``)."""

    def decorate(fn):
        opts = [
            click.option("--backend", type=click.Choice(analysis.BACKENDS), default="auto", show_default=True,
                         help="auto: the GPU kernels when a device and kernels exist, else the float64 reference."),
            click.option("--family", type=click.Choice(analysis.FAMILIES), default="int8", show_default=True,
                         help="int8: SageBwd; nvfp4: NVFP4 forward; qat: FP4 QAT."),
            click.option("--config", "config_name", type=click.Choice(analysis.CONFIG_NAMES), default="default",
                         show_default=True, help=_config_help()),
            click.option("--n", type=_POSITIVE, default=None,
                         help=f"Sequence length (Nq = Nk). Default {analysis.GPU_DEFAULT_N} on the GPU, "
                              f"{analysis.CPU_DEFAULT_N} on the reference."),
            click.option("--d", type=_POSITIVE, default=None,
                         help=f"Head dim [default: {analysis.DEFAULT_D}]. The GPU kernels take "
                              f"{' or '.join(str(d) for d in analysis.GPU_HEAD_DIMS)} (--backend gpu gives an "
                              f"error for another D, --backend auto runs the reference); the reference takes any D."),
            click.option("--heads", type=_POSITIVE, default=None,
                         help=f"Number of heads [default: {analysis.DEFAULT_HEADS}]."),
            click.option("--batch", type=_POSITIVE, default=None,
                         help=f"Batch size [default: {analysis.DEFAULT_BATCH}]."),
            click.option("--dtype", type=click.Choice(analysis.DTYPES), default="fp16", show_default=True,
                         help="Input dtype the float64 inputs are rounded to."),
            click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
            click.option("--causal/--no-causal", default=False, show_default=True,
                         help="Bottom-right aligned causal mask."),
            click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
            click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
                         help="Write to FILE instead of stdout."),
        ]
        if sigmas:
            opts.append(click.option("--sigmas", callback=_parse_sigmas, default=None, metavar="S1,S2,...",
                                     help="Comma-separated σ of Q and K [default: 1,3,5,8,10]."))
        if sigma:
            opts.append(click.option("--sigma", type=click.FloatRange(min=0, min_open=True), default=1.0,
                                     show_default=True, help="σ of the random Q and K."))
        if load:
            opts.append(click.option("--load", "load_path", type=click.Path(exists=True, dir_okay=False),
                                     default=None, metavar="FILE.npz",
                                     help="Study these inputs: an .npz with arrays q, k, v, do (4-D, --layout), "
                                          "instead of random ones."))
            opts.append(click.option("--layout", type=click.Choice(("HND", "NHD")), default="HND",
                                     show_default=True, help="Layout of the arrays in --load."))
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return decorate


@dataclass
class _Run:
    """What an analysis command resolved from its options, before it runs anything."""

    spec: analysis.RunSpec
    backend_reason: str
    notes: list  # lines for stderr, printed by announce() once every check passed

    def announce(self) -> None:
        for note in self.notes:
            click.echo(note, err=True)


def _prepare(opts: dict, *, loaded_d: int | None = None) -> _Run:
    """Resolve the backend and the default N and validate ``--out``; prints nothing yet.

    ``loaded_d``: the head dim of ``--load``'s file (the file gives the shape).
    Commands do their own checks next and call :meth:`_Run.announce` just
    before running, so a bad argument ends in exactly one line.
    """
    notes = []
    loaded_shape = loaded_d is not None
    head_dim = loaded_d if loaded_shape else opts["d"] or analysis.DEFAULT_D
    with _library_errors():
        try:
            backend, reason = analysis.resolve_backend(opts["backend"], opts["family"], head_dim=head_dim)
        except analysis.BackendUnavailable as exc:
            raise click.ClickException(_one_line(str(exc))) from None
        if opts["backend"] == "auto":
            notes.append(f"sagecupy: --backend auto -> {backend}: {reason}")
        n = opts["n"]
        if n is None:
            n = analysis.default_n(backend)
            if not loaded_shape:
                notes.append(f"sagecupy: N={n} (the {backend} backend's default; set it with --n)")
        shape = analysis.Shape(
            batch=opts["batch"] or analysis.DEFAULT_BATCH,
            heads=opts["heads"] or analysis.DEFAULT_HEADS,
            n=n,
            d=head_dim,
        )
        spec = analysis.RunSpec(family=opts["family"], config=opts["config_name"], backend=backend, shape=shape,
                                dtype=opts["dtype"], seed=opts["seed"], causal=opts["causal"])
    out = opts.get("out")
    if out is not None:
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder):
            raise click.ClickException(f"cannot write {out}: no such folder {folder}")
        if not os.access(folder, os.W_OK):
            raise click.ClickException(f"cannot write {out}: folder {folder} is not writable")
    return _Run(spec, reason, notes)


# ----------------------------------------------------------------------------
# the accuracy summary
# ----------------------------------------------------------------------------


def _command_line(replace: dict) -> str:
    """The current command with the options given on its command line (``--out``, ``--format`` dropped) and
    ``replace`` (long option name without dashes -> value) set: the command a summary suggests running next."""
    ctx = click.get_current_context()
    words = shlex.split(ctx.command_path)
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.opts[0].lstrip("-") in ("out", "format", *replace):
            continue
        source = ctx.get_parameter_source(param.name)
        if source not in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            flags = param.opts if value else param.secondary_opts
            words += flags[:1]
        elif param.name == "sigmas":
            words += [param.opts[0], ",".join(_fmt_sigma(s) for s in value)]
        else:
            words += [param.opts[0], str(value)]
    for name, value in replace.items():
        words += [f"--{name}", value]
    return " ".join(shlex.quote(w) for w in words)


def _comparison(opts: dict) -> str:
    """What to run to put the sweep beside the reference point of its family."""
    family, config = opts["family"], opts["config_name"]
    if family == "int8":
        if config == "paper":
            return f"the project default: {_command_line({'config': 'default'})}"
        return f"the published SageBwd granularities: {_command_line({'config': 'paper'})}"
    if family == "nvfp4":
        if config == "default":
            return f"without two-level P and K-smoothing: {_command_line({'config': 'plain'})}"
        return f"the NVFP4 default: {_command_line({'config': 'default'})}"
    return f"INT8 SageBwd on the same inputs: {_command_line({'family': 'int8', 'config': 'default'})}"


def _accuracy_summary(records: list[dict], sigmas, opts: dict) -> str:
    """One stderr line after the table: the worst cos and rel_l2 of each tensor over the sweep, and the command
    that runs the comparison (no second sweep runs here)."""
    worst = analysis.worst_case(records)
    at = {w[key] for w in worst for key in ("cos_sigma", "rel_l2_sigma")}
    where = f" (all at sigma {_fmt_sigma(at.pop())})" if len(at) == 1 and len(sigmas) > 1 else ""

    def one(w):
        text = f"{w['tensor']} cos {_fmt_cos(w['cos'])}"
        if not where and len(sigmas) > 1:
            text += f" (sigma {_fmt_sigma(w['cos_sigma'])})"
        text += f" rel_l2 {w['rel_l2']:.3g}"
        if not where and len(sigmas) > 1:
            text += f" (sigma {_fmt_sigma(w['rel_l2_sigma'])})"
        return text

    over = "sigma " + ",".join(_fmt_sigma(s) for s in sigmas)
    return f"sagecupy: worst over {over}{where}: {', '.join(one(w) for w in worst)}; {_comparison(opts)}"


# ----------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------


@click.group("sagecupy", cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
# The package's own version string, not the installed distribution's metadata: `python -m sagecupy --version`
# works from a checkout that was never installed.
@click.version_option(version=__version__, prog_name="sagecupy")
def main():
    """sagecupy: low-bit trainable attention (INT8 SageBwd, NVFP4, FP4 QAT), measured against float64.

    The analysis commands run on the GPU kernels when a device is available
    and on the float64 reference simulators otherwise (--backend).
    """


@main.command()
@click.option("--format", "fmt", type=click.Choice(("table", "json")), default="table", show_default=True)
def info(fmt):
    """Versions, GPU (or none) and which kernel families can run here."""
    from ._env import environment

    env = environment()
    families = [analysis.family_status(name) for name in analysis.FAMILIES]
    if fmt == "json":
        click.echo(json.dumps(_json_safe(dict(type="env", **env))))
        for status in families:
            click.echo(json.dumps(dict(type="family", **status)))
        return
    width = max(len(key) for key in env)
    for key, value in env.items():
        click.echo(f"{key.ljust(width)}  {'-' if value is None else value}")
    gpu_ok, gpu_reason = analysis.gpu_status()
    click.echo(f"{'gpu_kernels'.ljust(width)}  {'usable' if gpu_ok else 'not usable'}: {gpu_reason}")
    click.echo()
    rows = [dict(family=s["family"], what=s["title"],
                 reference="yes" if s["reference"] else "no (not built)",
                 gpu="yes" if s["gpu"] else f"no ({s['gpu_short']})") for s in families]
    columns = [("family", "family", str), ("what", "computes", str), ("reference", "float64 reference", str),
               ("gpu", "GPU kernels here", str)]
    click.echo(format_table(rows, columns))


@main.command()
@analysis_options(sigmas=True)
def accuracy(**opts):
    """σ-sweep (docs/algorithms.md §7.1): O, dQ, dK, dV vs float64 exact for Q, K ~ N(0, σ²)."""
    run = _prepare(opts)
    spec, sigmas = run.spec, opts["sigmas"]
    run.announce()
    with _library_errors(), _progress([f"sigma {_fmt_sigma(s)}" for s in sigmas], "sigma sweep") as step:
        records = analysis.accuracy_sweep(spec, sigmas, progress=step)
    head = analysis.header("accuracy", spec, backend_requested=opts["backend"], backend_reason=run.backend_reason,
                           sigmas=sigmas)
    emit(records, head, opts["fmt"], opts["out"])
    click.echo(_accuracy_summary(records, sigmas, opts), err=True)


@main.command()
@analysis_options(sigmas=True)
def smoothing(**opts):
    """Smoothing ablation (docs/algorithms.md §7.3): the σ-sweep without smoothing, with K-, with Q+K-smoothing."""
    run = _prepare(opts)
    spec, sigmas = run.spec, opts["sigmas"]
    with _library_errors():
        analysis.check_smoothing(spec)
    run.announce()
    steps = [f"{variant} smoothing, sigma {_fmt_sigma(s)}" for variant, _, _ in analysis.SMOOTHING_VARIANTS
             for s in sigmas]
    with _library_errors(), _progress(steps, "smoothing") as step:
        records = analysis.smoothing_ablation(spec, sigmas, progress=step)
    head = analysis.header("smoothing", spec, backend_requested=opts["backend"], backend_reason=run.backend_reason,
                           sigmas=sigmas)
    emit(records, head, opts["fmt"], opts["out"])


@main.command()
@analysis_options(sigma=True, load=True)
def intermediates(**opts):
    """Error and RMS of δ, P, dP, dS, O, dQ, dK, dV vs float64 exact, and the dS RMS bound (docs/algorithms.md §7.2).

    Random inputs (--sigma) by default; --load FILE.npz studies real activations
    (arrays q, k, v, do; the shape comes from the file, so --n, --d, --heads,
    --batch and --sigma do not apply).
    """
    path = opts["load_path"]
    if path is not None:
        given = [f"--{name}" for name in ("n", "d", "heads", "batch") if opts[name] is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} cannot be combined with --load (the file gives the shape)")
    inputs = None
    if path is not None:  # first: the file's head dim decides whether the GPU kernels can take it
        with _library_errors():
            inputs = analysis.load_inputs(path, dtype=opts["dtype"], layout=opts["layout"])
    run = _prepare(opts, loaded_d=None if inputs is None else inputs["q"].shape[-1])
    spec = run.spec
    run.announce()
    with _library_errors(), _progress([f"{spec.backend} run", "float64 exact run"], "intermediates") as step:
        records = analysis.intermediates(spec, sigma=opts["sigma"], inputs=inputs, progress=step)
    head = analysis.header("intermediates", spec, backend_requested=opts["backend"],
                           backend_reason=run.backend_reason,
                           inputs=inputs,
                           sigma=None if path else opts["sigma"], source=f"file {path}" if path else "random")
    emit(records, head, opts["fmt"], opts["out"])


#: The bench's input dtypes by the analysis commands' names.
_BENCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def bench_cases(*, quick: bool, d: int | None, n: int | None, causal: bool | None) -> list:
    """The sweep's (D, N, causal) cases (:func:`sagecupy.bench.default_cases`) narrowed by ``--d``, ``--n`` and
    ``--causal/--no-causal``; ``--n`` may name a length outside the sweep (it then replaces the sweep's lengths)."""
    from . import bench

    cases = bench.default_cases(quick=quick)
    if n is not None:
        cases = list(dict.fromkeys((cd, n, cc) for cd, _, cc in cases))
    return [(cd, cn, cc) for cd, cn, cc in cases if (d is None or cd == d) and (causal is None or cc == causal)]


#: ``--packed`` and ``--windows`` given alone (sagecupy._bench_common.DEFAULT_PACKED / DEFAULT_WINDOWS, which the
#: CLI does not import at start-up).
_DEFAULT_PACKED = (8, 32)
_DEFAULT_WINDOWS = (1024, 4096)


def bench_varlen_cases(cases, *, d, docs, windows) -> list:
    """The packed cases (16K tokens, each S of ``docs``) and window cases (each W of ``windows`` on the N of the
    dense ``cases``) for ``--d``'s head dim or both (:func:`sagecupy.bench.packed_cases`, ``window_cases``)."""
    from . import bench

    ds = (d,) if d is not None else tuple(sorted({cd for cd, _, _ in bench.default_cases()}))
    ns = tuple(sorted({cn for _, cn, _ in cases}))
    return ((bench.packed_cases(ds, docs) if docs else []) + (bench.window_cases(ds, ns, windows) if windows else []))


def _case_name(case) -> str:
    d, n, causal = case
    return f"D={d} N={n} {'causal' if causal else 'full'}"


@main.command("bench")
@click.option("--quick", is_flag=True, help="N in {4K, 16K} only (default: 1K ... 32K)")
@click.option("--configs", default="default", show_default=True,
              help=f"comma-separated INT8 configs: {', '.join(analysis.FAMILY_CONFIGS['int8'])}")
@click.option("--baselines", default=None,
              help="comma-separated attention baselines timed beside ('' for none; each needs PyTorch, cudnn-fp8 the "
                   "cuDNN frontend; one that cannot run is skipped with a line saying why): sdpa (PyTorch's default "
                   "SDPA), flash, cudnn (SDPA with that backend forced), cudnn-fp8 (cuDNN's FP8 attention) "
                   "[default: sdpa,cudnn-fp8,flash]")
@click.option("--memory/--no-memory", default=False, help="also peak memory of fwd+bwd at N=32K, D=128")
@click.option("--rep", type=click.IntRange(1), default=10, show_default=True, help="timed runs (median)")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="run the whole sweep this many times, one round after another; the table shows each row's median "
                   "over the rounds (the JSON lines keep every round's row, with its 'round')")
@click.option("--out", "out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="also write JSON lines to FILE as the rows come (environment header first; what `sagecupy plot` "
                   "reads)")
@click.option("--families", default="int8,nvfp4,qat", show_default=True,
              help="kernel families: int8 (SageBwd fwd/bwd), nvfp4 (inference fwd), qat (FP4 QAT fwd/bwd)")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="stdout: the table with ratios to the baselines, JSON lines (environment header first) or CSV")
@click.option("--dtype", type=click.Choice(tuple(_BENCH_DTYPES)), default="bf16", show_default=True,
              help="input dtype of sagecupy and the SDPA baselines (cudnn-fp8 casts from bf16 either way)")
@click.option("--d", type=click.Choice(tuple(str(d) for d in analysis.GPU_HEAD_DIMS)), default=None,
              help="only this head dim [default: both]")
@click.option("--n", type=_POSITIVE, default=None, help="only this sequence length (batch * N stays 16K tokens)")
@click.option("--causal/--no-causal", default=None, help="only causal / only non-causal cases [default: both]")
@click.option("--packed", default=None, is_flag=False, flag_value=",".join(map(str, _DEFAULT_PACKED)),
              metavar="S[,S...]",
              help="also packed batches: 16K tokens as S causal documents of random lengths (seeded, each >= 64 "
                   "tokens) in one call, for each S; the flag alone means 8,32 [default: none]")
@click.option("--windows", default=None, is_flag=False, flag_value=",".join(map(str, _DEFAULT_WINDOWS)),
              metavar="W[,W...]",
              help="also sliding windows: the sweep's shapes (--n, --d) causal with window (W, 0), for each W; the "
                   "flag alone means 1024,4096 [default: none]")
@click.option("--varlen-baselines", default=None,
              help="comma-separated baselines of --packed/--windows ('' for none; one that cannot run is skipped with "
                   "a line saying why): cudnn (cuDNN's bf16 SDPA, ragged THD / diagonal band), sdpa-docs (PyTorch "
                   "SDPA once per document), torch-varlen (torch.nn.attention.varlen), flex (FlexAttention) "
                   "[default: all]")
@click.option("--dense/--no-dense", default=True, show_default=True,
              help="the dense sweep (--no-dense: only --packed/--windows)")
def bench_cmd(quick, configs, baselines, memory, rep, rounds, out, families, fmt, dtype, d, n, causal, packed, windows,
              varlen_baselines, dense):
    """Speed of the kernels (fwd, bwd, fwd+bwd; kernel-only and end-to-end) beside SDPA, with ratios.

    Shapes: batch * N = 16K tokens, heads * D = 2048, D in {64, 128}, causal and not (docs/algorithms.md §8.1 FLOPs);
    --d, --n and --causal/--no-causal narrow the sweep. One line per finished case on stderr.
    """
    from . import bench
    from ._env import environment

    cfgs = tuple(c for c in configs.split(",") if c)
    for c in cfgs:
        if c not in analysis.FAMILY_CONFIGS["int8"]:
            raise click.UsageError(f"--configs: {c!r} is not one of {', '.join(analysis.FAMILY_CONFIGS['int8'])}")
    fams = tuple(f for f in families.split(",") if f)
    for f in fams:
        if f not in analysis.FAMILIES:
            raise click.UsageError(f"--families: {f!r} is not one of {', '.join(analysis.FAMILIES)}")
    try:
        bases = bench.DEFAULT_BASELINES if baselines is None else bench.parse_baselines(baselines)
        vbases = (bench.DEFAULT_VARLEN_BASELINES if varlen_baselines is None
                  else bench.parse_varlen_baselines(varlen_baselines))
        docs = bench.parse_int_list(packed, "--packed")
        wins = bench.parse_int_list(windows, "--windows")
    except ValueError as exc:
        raise click.UsageError(_one_line(str(exc))) from None
    cases = bench_cases(quick=quick, d=None if d is None else int(d), n=n, causal=causal)
    varlen_cases = bench_varlen_cases(cases, d=None if d is None else int(d), docs=docs, windows=wins)
    if not dense:
        if not varlen_cases:
            raise click.UsageError("--no-dense leaves nothing to time without --packed or --windows")
        cases = []
    ok, why = gpu_status()
    if not ok:
        raise click.ClickException(f"bench needs a CUDA device: {why}")
    env = dict(type="env", **environment())
    fh = open(out, "w") if out else None
    try:
        if fh:
            fh.write(json.dumps(_json_safe(env)) + "\n")
        names = ([_case_name(c) for c in cases] * rounds) + ([bench.case_name(c) for c in varlen_cases] * rounds)
        with _library_errors(), _progress(names, "bench") as step:
            rows = []
            if cases:
                rows += bench.run_suite(cases, configs=cfgs, baselines=bases, out=fh, rep=rep, families=fams,
                                        dtype=_BENCH_DTYPES[dtype], progress=lambda case: step(1), rounds=rounds)
            if varlen_cases:
                rows += bench.run_varlen_suite(varlen_cases, configs=cfgs, baselines=vbases, out=fh, rep=rep,
                                               families=fams, dtype=_BENCH_DTYPES[dtype],
                                               progress=lambda case: step(1), rounds=rounds)
            if memory:
                mem = bench.peak_memory(dtype=_BENCH_DTYPES[dtype])
                rows += mem
                if fh:
                    for r in mem:
                        fh.write(json.dumps(r) + "\n")
    finally:
        if fh:
            fh.close()
    if fmt == "table":
        click.echo(bench.format_rows(rows))
    else:
        click.echo(render(rows, env, fmt), nl=False)


#: --dtype's short names (the bench's) beside the dtypes' own.
_DTYPE_ALIASES = {"fp16": "float16", "bf16": "bfloat16"}


def _warmup_list(option: str, text: str, supported: tuple, aliases: dict | None = None, cast=str) -> tuple:
    """A comma-separated option value checked against ``supported``: a UsageError naming the option otherwise."""
    from ._warmup import _choices

    items = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            items.append(cast(item))
        except ValueError:
            items.append(item)
    try:
        return _choices(option, items, supported, aliases)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@main.command("warmup")
@click.option("--families", default="int8,nvfp4,qat", show_default=True, help="comma-separated kernel families")
@click.option("--dtype", "dtypes", default="fp16,bf16", show_default=True,
              help="comma-separated input dtypes: fp16, bf16 (or float16, bfloat16)")
@click.option("--d", "head_dims", default="64,128", show_default=True, help="comma-separated head dims")
@click.option("--engines", default=None, help="comma-separated: mma, wgmma [default: what the device runs; both on "
                                              "sm_90]")
@click.option("--jobs", type=_POSITIVE, default=1, show_default=True,
              help="modules compiled at once (above 1: in worker processes; NVRTC uses one core per compile)")
def warmup_cmd(families, dtypes, head_dims, engines, jobs):
    """Compile every kernel the families launch on this GPU into CuPy's disk cache, so later processes load them.

    One line per source file (modules, seconds compiling), then the total; a module that fails to compile is listed
    with its error and makes the exit status 1.
    """
    from . import _warmup

    fams = _warmup_list("--families", families, _warmup.FAMILIES)
    dts = _warmup_list("--dtype", dtypes, _warmup.DTYPES, _DTYPE_ALIASES)
    dims = _warmup_list("--d", head_dims, _warmup.HEAD_DIMS, cast=int)
    engs = None if engines is None else _warmup_list("--engines", engines, _warmup.ENGINES)
    ok, why = gpu_status()
    if not ok:
        raise click.ClickException(f"warmup needs a CUDA device: {why}")

    def on_file(filename, results):
        failed = [r for r in results if r.error is not None]
        click.echo(f"{filename:<32} {len(results):3d} module{'s' if len(results) != 1 else ' '} "
                   f"{sum(r.seconds for r in results):8.1f} s" + (f"  {len(failed)} FAILED" if failed else ""))
        for r in failed:
            lines = r.error.splitlines() or [""]
            click.echo(f"  FAILED {r.module.filename} [{r.module.arch or 'default arch'}] {r.module.names[0]}"
                       f"{f' (+{len(r.module.names) - 1} more)' if len(r.module.names) > 1 else ''}:")
            for line in lines[:30]:
                click.echo(f"    {line}")
            if len(lines) > 30:
                click.echo(f"    ... ({len(lines) - 30} more lines)")

    with _library_errors():
        summary = _warmup.warmup(fams, dts, dims, engs, jobs=jobs, on_file=on_file)
    for family, d, engine, reason in summary.skipped:
        click.echo(f"skipped {family} D={d} {engine}: {reason}")
    if summary.cache_note:
        click.echo(f"note: {summary.cache_note}")
    click.echo(f"warmup: {summary}; cache {_warmup.cache_dir()}")
    if summary.failures:
        sys.exit(1)


@main.command("plot")
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "outdir", type=click.Path(file_okay=False), default="plots", show_default=True)
def plot_cmd(results, outdir):
    """Speed-vs-N figures from `sagecupy bench --out FILE` (one PNG per head dim, mask and mode)."""
    from . import bench

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException("plot needs matplotlib: pip install 'sagecupy[plot]'") from None
    with _library_errors():
        paths = bench.plot(results, outdir)
    for p in paths:
        click.echo(p)


if __name__ == "__main__":  # python -m sagecupy.cli
    main()
