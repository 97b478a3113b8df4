"""`autotune submit | status | best | export | cancel`: talk to a controller over REST.

Each command is a thin wrapper over `autotune.cli.rest_client.Client`.  The controller's errors propagate to
`autotune.cli.app`, which prints them as ``error: <field>: <rule> (got <value>)`` and picks the exit code
(docs/cli.md); `status --follow` exits 1 itself when the job did not succeed.
"""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import typer
from pydantic import BaseModel
from rich.table import Table

from api.schemas import BestLayer, ConsumerPublic, JobPublic
from autotune.cli.consumer_options import FOR_HELP, For
from autotune.cli.local_token import read_token
from autotune.cli.output import console, write_out
from autotune.cli.progress import JobProgress, is_stopped_early, trials_run, waiting_reason
from autotune.cli.report import CPU_NOTE, hidden_text
from autotune.cli.rest_client import DEFAULT_CONTROLLER, ENDED, Client
from autotune.cli.shape_options import takes_shape, takes_shape_filter
from autotune.tuner.gpu import CPU, gpu_matches
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from search_spaces import FORMATS, FormatName, read_file
from search_spaces.consumers import Consumer, rendered, switch_lines
from search_spaces.export import ALTERNATIVES_SHOWN
from search_spaces.formats import exported_of

MAX_PORT = 65535


def controller_url(value: str) -> str:
    """``--controller`` as given, once it is an http(s) URL with a host: anything else is bad input (exit 2),
    found before any request, not a connection error (exit 1) or a worker retrying forever."""
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise InputError(
            "controller", "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000", value
        )
    if url.port is not None and not 0 < url.port <= MAX_PORT:
        raise InputError("controller", f"port must be 1 to {MAX_PORT}", value)
    return value


Controller = Annotated[
    str,
    typer.Option(envvar="AUTOTUNE_CONTROLLER", callback=controller_url, help="Controller URL (or AUTOTUNE_CONTROLLER)"),
]
Token = Annotated[
    str | None,
    typer.Option(envvar="AUTOTUNE_TOKEN", help="Bearer token (or AUTOTUNE_TOKEN; default: local token file)"),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON")]
Gpu = Annotated[str | None, typer.Option(help="GPU model, as NVML names it (NVIDIA H200) or short (h200)")]
JobGpu = Annotated[
    str | None,
    typer.Option(help="Only workers whose GPU model this names (NVIDIA H200, or short: h200); default: any worker"),
]


def _client(controller: str, token: str | None) -> Client:
    return Client(controller, token=token or read_token())


@takes_shape
def submit(
    shape: ModelShape,
    layers: Annotated[str, typer.Option(help="all, or slots separated by commas (qkv_fprop,fc2_fprop)")] = "all",
    trials: Annotated[int | None, typer.Option(help="Trials per slot (controller default: 30)")] = None,
    backend: Annotated[
        str | None, typer.Option(help="cpu | cuda | te (measured through TransformerEngine; controller default)")
    ] = None,
    gpu: JobGpu = None,
    consumer: For = None,
    follow: Annotated[bool, typer.Option("--follow", help="Then show progress until the job ends")] = False,
    controller: Controller = DEFAULT_CONTROLLER,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Queue a tuning job and print its id."""
    names = None if layers == "all" else [s.strip() for s in layers.split(",") if s.strip()]
    with _client(controller, token) as client:
        accepted = client.submit(
            shape=shape,
            layers=names,
            n_trials=trials,
            backend=backend,
            gpu=gpu,
            consumer=None if consumer is None else consumer.value,
        )
        typer.echo(accepted.model_dump_json() if as_json else accepted.id)
        job = client.job(accepted.id)
        if reason := waiting_reason(job):  # now, not after the user has waited for nothing
            typer.echo(f"warning: job {accepted.id} waits: {reason}", err=True)
        elif gpu is not None and (unmet := _gpu_unmet(client, gpu, job)):
            typer.echo(f"warning: job {accepted.id}: {unmet}", err=True)
        if follow:
            _follow(client, accepted.id, as_json=as_json)


def _gpu_unmet(client: Client, gpu: str, job: JobPublic) -> str | None:
    """What a job's ``--gpu`` does not get, when no registered worker has that GPU model: on the cpu backend
    it runs anyway (the backend has no GPU to choose), so say so rather than let it pass for a GPU run."""
    workers = client.workers()
    if any(w.gpu_model is not None and gpu_matches(w.gpu_model, gpu) for w in workers):
        return None
    fleet = ", ".join(f"{w.name} ({w.gpu_model or w.backend})" for w in workers) or "none"
    ignored = "; it runs on the cpu backend, which ignores --gpu (--backend cuda for a GPU run)"
    return f"no registered worker has a GPU {gpu} (registered: {fleet}){ignored if job.backend == CPU else ''}"


def status(
    job_id: Annotated[
        str, typer.Argument(help="Job id (from submit), or its first characters if no other job's share them")
    ],
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Live progress until the job ends")] = True,
    controller: Controller = DEFAULT_CONTROLLER,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Show a job: a live progress bar until it ends (on a terminal), then each slot's best config."""
    with _client(controller, token) as client:
        job_id = client.resolve_job(job_id)  # once: the prefix the dashboard shows, say
        if follow:
            _follow(client, job_id, as_json=as_json)
            return
        job = client.job(job_id)
        _print_job(job, as_json=as_json)


def _follow(client: Client, job_id: str, *, as_json: bool) -> None:
    """Follow the job's events (`JobProgress`: a bar on a terminal, lines elsewhere), print it, exit 1 unless
    it succeeded."""
    job = client.job(job_id)
    if job.status not in ENDED:
        with JobProgress(job_id) as shown:
            shown.show(job)  # at once: a job that waits says so now, not when its first event comes
            while job.status not in ENDED:
                for job in client.progress(job_id):
                    shown.show(job)
                job = client.job(job_id)  # the stream ended: done, or the server closed it (then follow again)
    _print_job(job, as_json=as_json)
    if job.status != "succeeded":
        raise typer.Exit(1)


def _print_job(job: JobPublic, *, as_json: bool) -> None:
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
        return
    p = job.progress
    typer.echo(f"job {job.id}: {job.status} ({trials_run(job)} of the budget, {p.fraction:.0%})")
    if reason := waiting_reason(job):
        typer.echo(f"waiting: {reason}")
    if job.error:
        typer.echo(f"error: {job.error}")
    table = Table("slot", "status", "trials", "best config", "overlap ms", "serial ms", "")
    for s in job.slots:
        best = s.best
        m = best.measurement if best else {}
        table.add_row(
            s.slot,
            s.status + (" (stopped early)" if is_stopped_early(job, s) else ""),
            f"{s.n_complete} ok / {s.n_failed} failed of {job.n_trials}",
            _config_text(best.config) if best else "-",
            _ms(m.get("overlap_ms")),
            _ms(m.get("serial_ms")),
            ("final" if best.final else "so far") if best else "",
        )
    console().print(table)
    if job.consumer_choice is not None:
        _print_consumer(job.consumer_choice)


@takes_shape_filter
def best(
    shape: dict[str, object],
    gpu: Gpu = None,
    consumer: For = None,
    controller: Controller = DEFAULT_CONTROLLER,
    token: Token = None,
    as_json: AsJson = False,
    samples: Annotated[
        bool, typer.Option("--samples", help="With --json: keep each measurement's raw timed samples and positions")
    ] = False,
) -> None:
    """Each slot's best config for a shape; says so plainly when only the nearest known preset is available.
    With ``--for``, also that consumer's joint winner: its switches and the other settings' summed times."""
    with _client(controller, token) as client:
        answer = client.best(shape, gpu=gpu, consumer=None if consumer is None else consumer.value)
    if as_json:
        data = answer.model_dump(mode="json")
        typer.echo(json.dumps(data if samples else _without_samples(data), indent=2))
        return
    if answer.nearest is not None:
        near = answer.nearest
        typer.echo(
            f"warning: NOT MEASURED: nothing was tuned for this shape; nearest known preset {near.source} "
            f"({near.distance:g} doublings away)",
            err=True,
        )
        table = Table("slot", "config (TE entry)", "note")
        for layer in answer.nearest_layers:
            table.add_row(layer.slot, _config_text(layer.config), layer.note or "")
        console().print(table)
        return
    for group in answer.results:
        on_cpu = group.gpu == CPU
        columns = ("slot", "best config", "overlap ms", "serial ms", "hidden", "TE-exact config", "TE-exact ms", "note")
        table = Table(*columns, title=f"{group.gpu} {group.shape_key}")
        for best in group.layers:
            m, exact = best.measurement or {}, best.te_exact
            table.add_row(
                best.slot,
                _config_text(best.config),
                _ms(m.get("overlap_ms")),
                _ms(m.get("serial_ms")),
                hidden_text(m.get("hidden_frac"), on_cpu=on_cpu),
                "none measured" if exact is None else _config_text(exact.config),
                "-" if exact is None else _ms(exact.measurement.get("overlap_ms")),
                "; ".join(n for n in (_slower_than_serial(best), best.note) if n),
            )
        console().print(table)
        if group.consumer is not None:
            _print_consumer(group.consumer)
        if on_cpu:
            typer.echo(CPU_NOTE, err=True)


RAW_SAMPLES = ("samples", "positions")
"""The keys of a measurement (`Measurement.to_dict`) and its baselines that hold every timed repeat: nearly all
of a shape's `best --json`, which only `--samples` keeps."""


def _without_samples(data: object) -> object:
    """``data`` (JSON) without the `RAW_SAMPLES` keys, at any depth."""
    if isinstance(data, dict):
        return {k: _without_samples(v) for k, v in data.items() if k not in RAW_SAMPLES}
    if isinstance(data, list):
        return [_without_samples(v) for v in data]
    return data


def _print_consumer(choice: ConsumerPublic) -> None:
    """A consumer's joint winner: what each slot runs, the switches, and every setting's summed time."""
    consumer = Consumer(choice.consumer)
    table = Table("slot", "runs", "TE-exact config", "overlap ms", title=f"for {choice.consumer}")
    for slot, entry in choice.slots.items():
        m = entry.measurement or {}
        config = "-" if entry.config is None else _config_text(entry.config)
        table.add_row(slot, entry.mode, config, _ms(m.get("overlap_ms")))
    console().print(table)
    for line in switch_lines(consumer, choice.setting):
        typer.echo(f"run with: {line}")
    typer.echo(f"settings compared (summed ms of {', '.join(choice.coupled)}):")
    for alternative in choice.alternatives[:ALTERNATIVES_SHOWN]:
        total = "not measured" if alternative.total_ms is None else f"{alternative.total_ms:.4g} ms"
        typer.echo(f"  {alternative.label}: {total}")
    if len(choice.alternatives) > ALTERNATIVES_SHOWN:
        typer.echo(f"  ... {len(choice.alternatives) - ALTERNATIVES_SHOWN} more (--json)")


SLOWER_NOTE = (
    "slower than serial in its own trial, yet faster than no overlap (none) measured beside it: "
    "the gap is within the noise"
)


def _slower_than_serial(layer: BestLayer) -> str | None:
    """The note for an overlap winner whose time is above its trial's serial time: the winner was picked
    against no overlap measured in the same finalist batch, so that gap is noise between trials."""
    m = layer.measurement or {}
    overlap, serial = m.get("overlap_ms"), m.get("serial_ms")
    slower = overlap is not None and serial is not None and overlap > serial
    return SLOWER_NOTE if slower and layer.config.to_config().overlaps else None


@takes_shape_filter
def export(
    shape: dict[str, object],
    gpu: Gpu = None,
    format: Annotated[
        FormatName,
        typer.Option("--format", help="; ".join(f"{f.name.value}: {f.help}" for f in FORMATS.values())),
    ] = FormatName.NEMO,
    consumer: Annotated[
        Consumer | None,
        typer.Option(
            "--for",
            help=f"{FOR_HELP}. Default: the format's own (nemo and bridge: megatron; te: te-modules)",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        str, typer.Option(help="File to write, or a folder (made if missing) for NVIDIA's file name: docs/cli.md")
    ] = ".",
    nearest: Annotated[
        bool,
        typer.Option(
            "--nearest",
            help="For a shape never tuned, write the nearest preset (a shape tuned here or NVIDIA's, by the "
            "distance of docs/export.md) instead of failing",
        ),
    ] = False,
    controller: Controller = DEFAULT_CONTROLLER,
    token: Token = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the file's path, whether it was measured, and the switches as JSON")
    ] = False,
) -> None:
    """Write the shape's preset file (NeMo/Megatron YAML of the TE-exact winners by default) and print its path;
    a shape never tuned is exit 1 naming the nearest tuned shapes, unless ``--nearest``."""
    with _client(controller, token) as client:
        preset = client.preset(
            shape,
            gpu=gpu,
            format=format.value,
            consumer=None if consumer is None else consumer.value,
            nearest=nearest,
        )
    if not preset.measured:
        typer.echo(f"warning: NOT MEASURED for this shape: the nearest preset is {preset.nearest}", err=True)
    name = preset.file_name or f"preset{FORMATS[format].suffix}"  # the controller names it
    path = write_out(out, preset.text, name=name)
    if not as_json:
        typer.echo(str(path))
        return
    made = exported_of(read_file(path)).preset
    switches = None if made.consumer is None else rendered(made.consumer, made.setting)
    consumer_name = None if made.consumer is None else made.consumer.value
    typer.echo(
        json.dumps({"file": str(path), "measured": preset.measured, "consumer": consumer_name, "switches": switches})
    )


def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id, or its first characters if no other job's share them")],
    controller: Controller = DEFAULT_CONTROLLER,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Cancel a job: nothing new starts; trials already running finish and are kept."""
    with _client(controller, token) as client:
        job = client.cancel(job_id)
    typer.echo(job.model_dump_json(indent=2) if as_json else f"job {job.id}: {job.status}")


workers_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Manage the controller's registered workers."
)
AdminToken = Annotated[
    str | None,
    typer.Option(
        envvar="AUTOTUNE_ADMIN_TOKEN",
        help="The controller's admin token (or AUTOTUNE_ADMIN_TOKEN); its clients' token where it has none",
    ),
]


@workers_app.command("revoke")
def revoke(
    worker_id: Annotated[str, typer.Argument(help="Worker id (GET /v1/workers)")],
    controller: Controller = DEFAULT_CONTROLLER,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Revoke a worker: its secret ends, its leased trials wait again for other workers, and its results leave
    the studies and the winners."""
    with _client(controller, admin_token) as client:
        revoked = client.revoke(worker_id)
    if as_json:
        typer.echo(revoked.model_dump_json(indent=2))
        return
    typer.echo(
        f"worker {revoked.worker_id}: revoked; {revoked.requeued} trials requeued, {revoked.withdrawn} results "
        f"withdrawn, {revoked.winners_removed} winners removed"
    )


@workers_app.command("enrol")
def enrol(
    ttl_s: Annotated[float, typer.Option(min=1, max=7 * 86400, help="How long the token registers a worker")] = 600,
    controller: Controller = DEFAULT_CONTROLLER,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Print a one-time enrolment token: one worker registers with it (``worker --worker-token TOKEN``), once,
    within --ttl-s."""
    with _client(controller, admin_token) as client:
        enrolment = client.enrol(ttl_s=ttl_s)
    typer.echo(enrolment.model_dump_json(indent=2) if as_json else enrolment.token)


def _config_text(config: BaseModel) -> str:
    """A config or TE entry as the JSON writes it, on one line: ``bulk use_ce=True``."""
    knobs = config.model_dump()
    rest = " ".join(f"{k}={v}" for k, v in knobs.items() if k != "method")
    return f"{knobs['method']} {rest}".strip()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
