"""``stratpack dashboard``: the Streamlit app over the run store, on this machine only unless told otherwise."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

LOCAL = ("127.0.0.1", "localhost", "::1")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="open the comparison dashboard over the run store")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--address", default="127.0.0.1", help="where to listen (default: this machine only)")
    p.add_argument("--port", type=int, default=8501)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("dashboard") is None:
        print("error: the dashboard needs streamlit and plotly: pip install -e '.[dashboard]' (scripts/setup.sh "
              "installs them)", file=sys.stderr)
        return 2
    from strategies.runs import RUNS_ENV, runs_dir

    app = os.path.join(os.path.dirname(importlib.util.find_spec("dashboard").origin), "app.py")
    env = {**os.environ, RUNS_ENV: str(runs_dir(args.runs_dir).resolve())}
    local = args.address in LOCAL
    host = f"[{args.address}]" if ":" in args.address else args.address  # an IPv6 address in a URL
    if not local:
        where = args.address or "all interfaces"
        print(f"warning: serving on {where}: anyone who can reach this machine on port {args.port} can "
              "read the run store", file=sys.stderr)
    print(f"dashboard: http://{host}:{args.port} over {env[RUNS_ENV]} (Ctrl-C stops it)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "streamlit", "run", app, "--server.address", args.address, "--server.port",
           str(args.port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
           # On the command line, so neither a STREAMLIT_* variable nor a .streamlit/config.toml turns them off.
           "--server.enableXsrfProtection", "true", "--server.enableCORS", "true"]
    if local:  # a page on another site that resolves its name to 127.0.0.1 (DNS rebinding) is not served
        cmd += [arg for name in LOCAL for arg in ("--server.allowedHosts", name)]
    sys.stdout.flush()
    sys.stderr.flush()
    # Become the server (exec, not a child): stopping this process stops the server, nothing is left running.
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def wait_until_up(url: str, timeout_s: float = 60.0) -> bool:
    """Whether the dashboard at ``url`` answers Streamlit's health check within ``timeout_s`` (for a caller that
    started it: the screenshot script, the browser tests)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return True
        except OSError:
            time.sleep(0.3)
    return False
