"""`pdserve up`: start a local topology (prefill/decode instances or collocated replicas) behind the proxy.

    pdserve up --demo                           # embedded SmolLM2, 1P1D + proxy, one request, Ctrl-C stops
    pdserve up ./model --topology 2p1d --gpus 0,1,2
    pdserve up ./model --topology collocated:2 -- --max-model-len 4096    # after --: args of every instance
    pdserve up --config deploy.yaml --dry-run   # print the equivalent shell commands
    pdserve up Qwen/Qwen2.5-7B-Instruct --engine vllm --gpus 0,1 --dry-run

Instances start first (each in its own process group, logs in --log-dir, default a new folder under
~/.cache/pdserve/logs/), then the proxy once every instance answers GET /health. When all is ready a line
`PDSERVE_READY proxy=URL ...` is printed for scripts. While serving, a process that dies is restarted
(same ports) after a backoff of 1, 2, 4 ... s while the others keep serving; the proxy routes around it
(decode instances prefill locally while no prefill instance is up). More than --max-restarts deaths of one
process within --restart-window s is a crash loop: its last log lines are shown and everything stops.
The proxy's admin route gets a generated key, in the file admin-key (mode 0600) of the log folder.
Ctrl-C or SIGTERM stops everything: SIGTERM to every process group, a bounded wait, SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx

from pdserve.launch import procs as launch_procs
from pdserve.launch.config import ENGINES, LaunchConfig, apply_file, load_file, parse_topology
from pdserve.launch.spec import (
    ADMIN_KEY_ENV,
    KV_SECRET_ENV,
    Deployment,
    ProcSpec,
    build_deployment,
    cpu_list,
    format_shell,
)
from pdserve.launch.supervise import RestartPolicy, RestartTracker

TAIL_LINES = 25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder or short name (default: the embedded SmolLM2-135M)")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the MODEL argument")
    parser.add_argument("--topology", default=None,
                        help="collocated[:N], 1p1d (default) or XpYd, e.g. 2p1d")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML or TOML file of these settings")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="pdserve (default) or vllm: real `vllm serve` instances with NixlConnector")
    parser.add_argument("--host", default=None, help="address every process binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="proxy port (default 8192, or a free one if busy; 0 = any free port)")
    parser.add_argument("--base-port", type=int, default=None,
                        help="instance ports: prefill/collocated at BASE+i, decode at BASE+100+i, side channels "
                        "at BASE+200+k (default: free ports)")
    parser.add_argument("--gpus", default=None,
                        help="GPU ids, assigned round-robin (CUDA_VISIBLE_DEVICES per instance); 'none' = CPU; "
                        "default auto (all visible GPUs, else CPU)")
    parser.add_argument("--no-cpu-pinning", action="store_true",
                        help="CPU mode: do not split the cores among instances")
    parser.add_argument("--log-dir", default=None, help="where prefill.log, decode.log, proxy.log go "
                        "(default: a new folder under ~/.cache/pdserve/logs/, printed at start)")
    parser.add_argument("--startup-timeout", type=float, default=None,
                        help="seconds for every instance to become healthy (default 600)")
    parser.add_argument("--stop-timeout", type=float, default=None,
                        help="seconds between SIGTERM and SIGKILL at teardown (default 15)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="while serving, restarts of one process within --restart-window before the deployment "
                        "stops as a crash loop (default 5; 0 = stop at the first death)")
    parser.add_argument("--restart-window", type=float, default=None,
                        help="seconds over which restarts are counted (default 600)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                        help="arguments for every instance, shell-quoted; repeatable (--serve-arg='--block-size 8')")
    parser.add_argument("--prefill-arg", action="append", default=[], metavar="ARGS", help="prefill instances only")
    parser.add_argument("--decode-arg", action="append", default=[], metavar="ARGS", help="decode instances only")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel size of every instance (vLLM's flag; --prefill-tp and the like "
                        "override it per role)")
    for role in ("prefill", "decode", "collocated"):
        parser.add_argument(f"--{role}-tp", type=int, default=None, metavar="N",
                            help=f"tensor-parallel size of each {role} instance (N GPUs each, or N CPU processes)")
    parser.add_argument("--collocated-arg", action="append", default=[], metavar="ARGS",
                        help="collocated replicas only")
    parser.add_argument("--proxy-arg", action="append", default=[], metavar="ARGS", help="arguments for the proxy")
    parser.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default=None,
                        help="kv_load_failure_policy of the decode instances (default fail)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default=None,
                        help="KV cache dtype of every instance (vLLM's flag; fp8 halves KV memory and transfer bytes)")
    parser.add_argument("--attention-backend", choices=("auto", "triton", "triton-cudnn", "flashinfer"), default=None,
                        help="GPU attention backend of every instance (`pdserve serve --attention-backend`)")
    parser.add_argument("--kv-history", action="store_true", default=None,
                        help="multi-turn over P/D: decode instances keep each conversation's KV for the next turn, "
                             "whose prefill reads it back (vLLM's bidirectional_kv_xfer)")
    parser.add_argument("--kv-transfer-mode", choices=("pull", "push"), default=None,
                        help="pull (default): decode instances READ the KV after the prefill (NixlConnector); push: "
                             "the proxy sends both legs at once, decode instances register the blocks they lack "
                             "and the prefill WRITEs each layer's KV as it computes it (NixlPushConnector)")
    parser.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=None,
                        help="instances publish KV events (vLLM's ZMQ format) and the proxy routes each request to "
                             "the instance holding most of its prefix. Default: on in every role with more than one "
                             "instance (where there is a choice to make); --kv-events: in every role; "
                             "--no-kv-events: nowhere")
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                        help="a host-memory KV tier of this size in every instance (vLLM's flag; backend native)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding on the decode and collocated instances (`pdserve serve "
                             "--speculative-config`; prefill legs make one token and never speculate)")
    parser.add_argument("--dry-run", action="store_true", help="print the equivalent shell commands and exit")
    parser.add_argument("--demo", action="store_true",
                        help="once ready, send one request through the proxy; print answer, TTFT, KV transfer line")
    parser.add_argument("--exit", "--once", dest="exit_after", action="store_true",
                        help="with --demo: stop everything after the demo (exit 0 if it succeeded)")
    parser.add_argument("--demo-prompt", default=None, help="prompt of the demo request")
    parser.add_argument("--demo-max-tokens", type=int, default=24, help="max_tokens of the demo request (default 24)")
    from pdserve.launch.ray_cli import add_ray_arguments

    add_ray_arguments(parser)
    parser.epilog = "Arguments after -- are added to every instance's serve command."
    _split_double_dash(parser)


def _split_double_dash(parser: argparse.ArgumentParser) -> None:
    """Make `pdserve up [...] -- ARGS` put ARGS into `args.passthrough` untouched.

    argparse cannot take positionals after options that already filled its positionals, so the words
    after `--` are cut off before this subparser parses the rest.
    """
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):  # type: ignore[no-untyped-def]
        words = list(sys.argv[1:] if args is None else args)
        rest: list[str] = []
        if "--" in words:
            i = words.index("--")
            words, rest = words[:i], words[i + 1 :]
        elif "--" in sys.argv[1:]:  # a parent parser already dropped the `--`
            after = sys.argv[sys.argv.index("--", 1) + 1 :]
            if after and words[-len(after) :] == after:
                words, rest = words[: -len(after)], after
        ns, extras = original(words, namespace)
        ns.passthrough = rest
        return ns, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    cfg = LaunchConfig()
    if args.config:
        apply_file(cfg, load_file(args.config), args.config)
    model, extra = args.model, list(getattr(args, "passthrough", []))
    if model is not None and args.model_flag is not None and model != args.model_flag:
        raise ValueError(f"two models given: {model!r} and --model {args.model_flag!r}")
    model = model or args.model_flag
    if model is not None:
        cfg.model = model
    if args.topology is not None:
        cfg.topology = parse_topology(args.topology)
    for name in ("engine", "host", "port", "base_port", "gpus", "startup_timeout", "stop_timeout",
                 "kv_load_failure_policy", "max_restarts", "restart_window"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.no_cpu_pinning:
        cfg.cpu_pinning = False
    if args.log_dir is not None:
        cfg.log_dir = Path(args.log_dir)
    cfg.serve_args += [w for a in args.serve_arg for w in shlex.split(a)] + extra
    if args.kv_cache_dtype is not None:  # both pools must agree: the KV handshake refuses a mismatch
        cfg.serve_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.attention_backend is not None:
        cfg.serve_args += ["--attention-backend", args.attention_backend]
    if args.kv_history:
        cfg.kv_history = True
    if args.kv_transfer_mode is not None:
        cfg.kv_transfer_mode = args.kv_transfer_mode
    if args.kv_events is not None:
        cfg.kv_events = args.kv_events
    if args.kv_offloading_size is not None:
        if args.kv_offloading_size <= 0:
            raise ValueError("--kv-offloading-size must be > 0 GiB")
        cfg.serve_args += ["--kv-offloading-size", f"{args.kv_offloading_size:g}", "--kv-offloading-backend", "native"]
    if args.speculative_config is not None:
        for role in ("decode", "collocated"):
            cfg.pools[role].serve_args += ["--speculative-config", args.speculative_config]
    for role in ("prefill", "decode", "collocated"):
        cfg.pools[role].serve_args += [w for a in getattr(args, f"{role}_arg") for w in shlex.split(a)]
        if getattr(args, f"{role}_tp") is not None:
            cfg.pools[role].tp = getattr(args, f"{role}_tp")
        elif args.tensor_parallel_size is not None:
            cfg.pools[role].tp = args.tensor_parallel_size
    cfg.proxy_args += [w for a in args.proxy_arg for w in shlex.split(a)]
    if args.exit_after and not args.demo:
        raise ValueError("--exit/--once needs --demo")
    if args.demo_max_tokens < 1:
        raise ValueError("--demo-max-tokens must be >= 1")
    return cfg.validate()


def _say(text: str = "") -> None:
    print(text, flush=True)


def _describe(spec: ProcSpec) -> str:
    if spec.role == "proxy":
        return f"  {spec.name:<12} {spec.url:<24} log {spec.log_path}"
    where = (f"GPU{'s' if ',' in spec.gpu else ''} {spec.gpu}" if spec.gpu is not None
             else f"CPUs {cpu_list(spec.cpus)}" if spec.cpus else "CPU")
    sc = f", side channel :{spec.side_channel_port}" if spec.side_channel_port else ""
    return f"  {spec.name:<12} {spec.url:<24} ({where}{sc})  log {spec.log_path}"


def _model_arg(cfg: LaunchConfig, dry_run: bool) -> str:
    """What MODEL the instances get. The embedded default is resolved (converted once) here, before the
    instances start, so that they do not all convert it at once; vLLM gets the converted folder."""
    from pdserve.model.default_model import DEFAULT_MODEL, MODELS, is_converted, resolve_model

    name = cfg.model or DEFAULT_MODEL
    if name not in MODELS or dry_run and cfg.engine == "pdserve":
        return name
    if not is_converted(name):
        _say(f"preparing model {name} (converting the embedded GGUF once) ...")
    folder = str(resolve_model(name))
    return folder if cfg.engine == "vllm" else name


class _Stop:
    """SIGINT/SIGTERM/SIGHUP set a flag; the launcher's loops poll it and tear down in order."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        self.event.set()

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]

    def __call__(self) -> bool:
        return self.event.is_set()


def _how_it_ended(child: launch_procs.Child) -> str:
    code = child.exited()
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _print_tail(child: launch_procs.Child, lines: int = TAIL_LINES) -> None:
    tail = launch_procs.tail(child.spec.log_path, lines)
    if not any(line.strip() for line in tail):
        print(f"  | (nothing in {child.spec.log_path})", file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()


def _report_death(child: launch_procs.Child, when: str) -> None:
    print(f"pdserve up: {child.name} {_how_it_ended(child)} {when}. Last lines of {child.spec.log_path}:",
          file=sys.stderr)
    _print_tail(child)


def _ready_line(dep: Deployment, model: str | None, log_dir: Path, children: list[launch_procs.Child]) -> str:
    fields = {
        "proxy": dep.proxy.url,
        "prefill": ",".join(s.url for s in dep.role("prefill")),
        "decode": ",".join(s.url for s in dep.role("decode") + dep.role("collocated")),
        "model": model or dep.model,
        "log_dir": str(log_dir),
        "pid": str(os.getpid()),
        "pids": ",".join(str(c.pid) for c in children),
    }
    return "PDSERVE_READY " + " ".join(f"{k}={shlex.quote(v)}" for k, v in fields.items() if v)


def _curl(proxy_url: str, model: str | None) -> str:
    import json

    body = {"prompt": "Say hello.", "max_tokens": 16}
    if model:
        body = {"model": model, **body}
    return (f"curl -s {proxy_url}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


class _Session:
    """The running deployment: its children (in start order), the watchdog, the stop flag."""

    def __init__(self, cfg: LaunchConfig, stopping: _Stop, env: dict[str, str], say: Callable[[str], None]):
        self.cfg = cfg
        self.stopping = stopping
        self.env = env
        self.say = say
        self.children: list[launch_procs.Child] = []
        self.watchdog = launch_procs.Watchdog(cfg.stop_timeout)

    def start(self, spec: ProcSpec) -> launch_procs.Child:
        child = launch_procs.start(spec, self.env)
        self.children.append(child)
        self.watchdog.watch(child)
        return child

    def start_all(self, dep: Deployment) -> launch_procs.ReadyResult:
        """Instances wave by wave (each wave once the previous one is healthy), then the proxy."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        for wave in sorted({spec.wave for spec in dep.instances}):
            running = list(self.children)
            batch = [self.start(spec) for spec in dep.instances if spec.wave == wave]
            self.say(f"waiting for {', '.join(c.name for c in batch)} to answer /health "
                     f"(up to {deadline - time.monotonic():.0f}s) ...")
            ready = launch_procs.wait_ready(batch, max(1.0, deadline - time.monotonic()), stopping=self.stopping,
                                            report=self.say, watch=running)
            if not ready.ok:
                return ready
        proxy = self.start(dep.proxy)
        self.say(_describe(dep.proxy))
        return launch_procs.wait_ready([proxy], max(30.0, self.cfg.startup_timeout / 10), stopping=self.stopping,
                                       report=self.say, watch=self.children[:-1])

    def report_not_ready(self, ready: launch_procs.ReadyResult) -> int:
        if ready.failed is not None:
            _report_death(ready.failed, "during startup")
            return 1
        for child in ready.timed_out or []:
            print(f"pdserve up: {child.name} not ready in time; last lines of {child.spec.log_path}:",
                  file=sys.stderr)
            _print_tail(child)
        if ready.timed_out:
            return 1
        return 130 if self.stopping.signum == signal.SIGINT else 143

    def serve_until_stopped(self) -> int:
        """Watch the children; restart the dead ones (backoff) until stopped or a crash loop."""
        self.say("serving; Ctrl-C stops everything.")
        policy = RestartPolicy(self.cfg.max_restarts, self.cfg.restart_window).validate()
        tracker = RestartTracker(policy)
        due: dict[str, float] = {}  # name -> when to restart it
        recovering: dict[str, launch_procs.Child] = {}  # restarted, not yet answering /health
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while not self.stopping.event.wait(0.25):
                for child in self.children:
                    if child.name in due or child.exited() is None:
                        continue
                    recovering.pop(child.name, None)
                    delay = tracker.on_death(child.name)
                    if delay is None:
                        _report_death(child, f"while serving, after {policy.max_restarts} restart(s) within "
                                      f"{policy.window_s:g}s (crash loop)")
                        return 1
                    print(f"pdserve up: {child.name} (pid {child.pid}) {_how_it_ended(child)}; restarting it in "
                          f"{delay:g}s (restart {tracker.count(child.name)} of at most {policy.max_restarts} "
                          f"within {policy.window_s:g}s). Last lines of {child.spec.log_path}:", file=sys.stderr)
                    _print_tail(child, 8)
                    child.signal_group(signal.SIGKILL)  # what is left of its process group
                    due[child.name] = time.monotonic() + delay
                for name, when in list(due.items()):
                    index = next(i for i, c in enumerate(self.children) if c.name == name)
                    old = self.children[index]
                    if time.monotonic() < when or old.group_alive():
                        continue
                    del due[name]
                    old.log.close()
                    new = launch_procs.start(old.spec, self.env, restart=tracker.count(name))
                    self.children[index] = new
                    self.watchdog.watch(new)
                    recovering[name] = new
                    self.say(f"pdserve up: {name} restarted (pid {new.pid}); waiting for it to answer /health")
                for name, child in list(recovering.items()):
                    try:
                        ok = client.get(child.spec.url + "/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        del recovering[name]
                        self.say(f"pdserve up: {name} ready again (pid {child.pid}) at {child.spec.url}")
        return 0

    def stop(self) -> None:
        if self.children:
            self.say("stopping: " + ", ".join(f"{c.name} (pid {c.pid})" for c in reversed(self.children)))
            # the proxy first, so that clients get refusals rather than errors mid-request
            for problem in launch_procs.stop_all(list(reversed(self.children)), self.cfg.stop_timeout):
                print(f"pdserve up: {problem}", file=sys.stderr)
            self.say("stopped.")
        self.watchdog.close()


def _log_interval(env: dict[str, str]) -> float:
    """Seconds between the instances' `KV Transfer metrics` log lines (vLLM's VLLM_LOG_STATS_INTERVAL)."""
    try:
        return max(0.0, float(env.get("VLLM_LOG_STATS_INTERVAL", "10")))
    except ValueError:
        return 10.0


def _interruptible(fn: Callable[[], bool], stopping: _Stop) -> bool | None:
    """Run `fn` in a thread so that Ctrl-C is not held up by a slow request; None if stopped first."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    while thread.is_alive() and not stopping():
        thread.join(0.2)
    return result[0] if result else None


def _write_admin_key(path: Path) -> str:
    """A new random key in `path`, readable by this user only."""
    key = secrets.token_urlsafe(32)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def run(cfg: LaunchConfig, dep: Deployment, *, demo: bool, exit_after: bool, demo_prompt: str | None,
        demo_max_tokens: int, say: Callable[[str], None] = _say) -> int:
    """Start everything, wait for readiness, optionally run the demo, serve until stopped; tear down."""
    from pdserve.launch.demo import DEFAULT_PROMPT, run_demo, served_model

    t0 = time.monotonic()
    env = dict(os.environ)
    assert cfg.log_dir is not None  # build_deployment resolved it
    if demo and "VLLM_LOG_STATS_INTERVAL" not in env:
        env["VLLM_LOG_STATS_INTERVAL"] = "1"  # so that the demo shows the log line without waiting 10 s
    with _Stop() as stopping:
        session = _Session(cfg, stopping, env, say)
        try:
            say(f"pdserve up: topology {cfg.topology}, engine {cfg.engine}, {dep.device}, model {dep.model}")
            for note in dep.notes:
                say(f"  note: {note}")
            for spec in dep.instances:
                say(_describe(spec))
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            say(f"  logs in {cfg.log_dir}")
            if dep.admin_key_file is not None:
                dep.proxy.env[ADMIN_KEY_ENV] = _write_admin_key(dep.admin_key_file)
                say(f"  proxy admin key (POST /pdserve/instances) in {dep.admin_key_file}")
            if dep.kv_secret:
                # One secret per deployment, in the instances' environment only (restarts reuse their spec).
                secret = secrets.token_hex(32)
                for spec in dep.instances:
                    spec.env[KV_SECRET_ENV] = secret
                say(f"  KV side channels authenticated with a secret of this deployment ({KV_SECRET_ENV})")
            ready = session.start_all(dep)
            if not ready.ok:
                return session.report_not_ready(ready)
            model = served_model((dep.role("decode") + dep.role("collocated"))[0].url)
            say(f"ready in {time.monotonic() - t0:.1f}s. Client endpoint (OpenAI API): {dep.proxy.url}/v1")
            say(f"  try: {_curl(dep.proxy.url, model)}")
            say(_ready_line(dep, model, cfg.log_dir, session.children))
            if demo:
                decodes = dep.role("decode")
                ok = _interruptible(lambda: run_demo(
                    dep.proxy.url, model, [s.url for s in decodes], [s.log_path for s in decodes],
                    prompt=demo_prompt or DEFAULT_PROMPT, max_tokens=demo_max_tokens,
                    wait_log_s=_log_interval(env) + 2.0, say=say,
                ), stopping)
                if ok is None:  # stopped during the demo
                    return 130 if stopping.signum == signal.SIGINT else 143
                if exit_after:
                    return 0 if ok else 1
            return session.serve_until_stopped()
        finally:
            session.stop()


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    if args.ray is not None:
        from pdserve.launch import ray_cli

        return ray_cli.main(args, cfg)
    if cfg.engine == "vllm" and not args.dry_run and shutil.which("vllm") is None:
        print("pdserve up: --engine vllm needs the `vllm` command on PATH (pip install vllm nixl); "
              "--dry-run prints the commands without it", file=sys.stderr)
        return 2
    try:
        model_arg = _model_arg(cfg, args.dry_run)
        dep = build_deployment(cfg, model_arg=model_arg)
    except (ValueError, OSError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(format_shell(dep, cfg))
        return 0
    return run(cfg, dep, demo=args.demo, exit_after=args.exit_after, demo_prompt=args.demo_prompt,
               demo_max_tokens=args.demo_max_tokens)
