"""The dashboard's surface (issue #10): where `stratpack dashboard` listens, that Streamlit's XSRF protection stays
on, that nothing outside the run store is read (links, odd names, query parameters), and that a broken or hostile
run store (huge, binary, truncated, non-JSON files, wrong-schema metadata) gives a message for that run while the
rest of every page still works.

One fixture store holds good runs beside one folder per hostile case (CASES); the data tests check each case's
message, the AppTest test walks every page once over the whole store.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from dashboard import data  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # a reader that blocks (a pipe) must fail the test, not hang the suite

runstore = data.runstore  # the stdlib reader the dashboard uses (no torch)
ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "dashboard" / "app.py")
CMP = "cmp-surface"
SECRET = "canary-7f3e-outside-the-store"  # in every file outside the store: it must appear nowhere
PASSWD = "root:x:0:0"
PAGES = ("Compare", "Memory", "Throughput", "Communication", "Loss", "Pipeline")
LOSSES = [2.0, 1.5, 1.2]
PIPELINE = {
    "bubble_ideal": 0.2, "bubble_measured": 0.3, "partition": ["stage 0: blocks[0:1]", "stage 1: blocks[1:2]"],
    "timelines": {"0": [{"action": "F0.0", "phase": "F", "start": 0.0, "end": 1.0},
                        {"action": "B0.0", "phase": "B", "start": 3.0, "end": 5.0}],
                  "1": [{"action": "F1.0", "phase": "F", "start": 1.0, "end": 2.0},
                        {"action": "B1.0", "phase": "B", "start": 2.0, "end": 3.0}]},
    "ideal": {"0": [["F0.0", 0], ["B0.0", 3]], "1": [["F1.0", 1], ["B1.0", 2]]},
}


# -- a run store: good runs, and one folder per hostile case -------------------------------------------------------


def _meta(run_id: str, label: str, world: int = 1, **extra) -> dict:
    return {"schema": 1, "run_id": run_id, "comparison": CMP, "label": label, "plan": label, "world_size": world,
            "degrees": {"dp": world, "tp": 1, "pp": 1}, "devices": ["cpu"], "num_params": 1000,
            "predicted": {"memory": [{"params": 100, "grads": 100, "optimizer": 200, "host": 0, "activations": 50}]
                          * world}, **extra}


def _record(rank: int, step: int, loss: float, **extra) -> dict:
    return {"schema": 1, "rank": rank, "step": step, "time": 100.0 + step, "step_time_s": 1.0, "loss": loss,
            "tokens_per_s": 1000.0, "memory": {"params": 100, "grads": 100, "optimizer": 200, "host": 0, "total": 400,
                                               "activations_peak": 60},
            "comm": {"all_reduce/dp": {"calls": 1, "bytes_sent": 10.0, "bytes_recv": 10.0, "wait_s": 0.1}}, **extra}


def _lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def _summary(**extra) -> dict:
    return {"schema": 1, "status": "complete", "losses": LOSSES, "tokens_per_s": 1000.0, "mfu": None,
            "comm_per_step": {"all_reduce/dp": {"calls": 1, "bytes_sent": 10.0, "bytes_recv": 10.0, "wait_s": 0.1}},
            **extra}


def _run(folder: Path, label: str = "dp", world: int = 1, *, meta: dict | None = None, complete: bool = True,
         **summary) -> Path:
    """A valid run (each case then breaks one thing in it)."""
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(meta or _meta(folder.name, label, world)))
    for rank in range(world):
        (folder / f"rank{rank:05d}.jsonl").write_bytes(
            _lines(*(_record(rank, step, loss) for step, loss in enumerate(LOSSES, start=1))))
    if complete:
        (folder / "summary.json").write_text(json.dumps(_summary(**summary)))
    return folder


def _write(name: str, content: bytes | str):
    def make(folder: Path, outside: Path) -> None:
        _run(folder, world=2)
        target = folder / name
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    return make


def _link(name: str, target):
    def make(folder: Path, outside: Path) -> None:
        _run(folder, world=2)
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(target(outside) if callable(target) else target)
    return make


def _with_meta(**fields):
    def make(folder: Path, outside: Path) -> None:
        meta = _meta(folder.name, "dp")
        for key, value in fields.items():
            if value is _DROP:
                del meta[key]
            else:
                meta[key] = value
        _run(folder, meta=meta)
    return make


def _with_summary(**fields):
    return lambda folder, outside: _run(folder, **fields)


def _huge(name: str):
    def make(folder: Path, outside: Path) -> None:
        _run(folder, world=2)
        with open(folder / name, "wb") as f:  # sparse: no disk used
            f.truncate(data.MAX_FILE_BYTES + 1)
    return make


def _truncated(folder: Path, outside: Path) -> None:
    _run(folder, world=2)
    log = folder / "rank00001.jsonl"
    log.write_bytes(log.read_bytes()[:-40])  # a finished run whose log was cut mid-line (a copy, a full disk)


def _fifo(folder: Path, outside: Path) -> None:
    _run(folder, world=2)
    (folder / "rank00001.jsonl").unlink()
    os.mkfifo(folder / "rank00001.jsonl")  # opening it to read would block the page forever


def _rank_dir(folder: Path, outside: Path) -> None:
    _run(folder, world=2)
    (folder / "rank00001.jsonl").unlink()
    (folder / "rank00001.jsonl").mkdir()


def _dir_link(folder: Path, outside: Path) -> None:
    folder.symlink_to(outside / "run", target_is_directory=True)


def _incomplete(folder: Path, outside: Path) -> None:
    _run(folder, complete=False)
    with open(folder / "rank00000.jsonl", "ab") as f:
        f.write(b"oops\n")


_DROP = object()
_BINARY = random.Random(0).randbytes(8192)
_PAIR_LINK = lambda outside: outside / "secret.jsonl"  # noqa: E731

# name -> (make the folder, what its message says, whether the run is still shown)
CASES = {
    # links: never followed, wherever they point (outside the store, /etc/passwd, back inside it)
    "l-run-folder-link": (_dir_link, "a link, not a folder of the run store", False),
    "l-meta-link": (_link("meta.json", lambda o: o / "meta.json"), "meta.json is not a regular file", False),
    "l-rank-passwd": (_link("rank00000.jsonl", "/etc/passwd"), "rank00000.jsonl is not a regular file", False),
    "l-rank-outside": (_link("rank00001.jsonl", _PAIR_LINK), "rank00001.jsonl is not a regular file", False),
    "l-rank-dotdot": (_link("rank00001.jsonl", "../../outside/secret.jsonl"), "rank00001.jsonl is not a", False),
    "l-rank-inside": (_link("rank00001.jsonl", "../good-single/rank00000.jsonl"), "rank00001.jsonl is not a", False),
    "l-summary-link": (_link("summary.json", lambda o: o / "summary.json"), "summary.json is not a regular file",
                       False),
    "l-rank-fifo": (_fifo, "rank00001.jsonl is not a regular file", False),
    "l-rank-folder": (_rank_dir, "rank00001.jsonl is not a regular file", False),
    # files too large to read: refused from their size alone
    "h-huge-rank": (_huge("rank00001.jsonl"), "rank00001.jsonl is 268,435,457 bytes, over the", False),
    "h-huge-meta": (_huge("meta.json"), "meta.json is 268,435,457 bytes, over the", False),
    "h-huge-summary": (_huge("summary.json"), "summary.json is 268,435,457 bytes, over the", False),
    # meta.json: not JSON, not an object, another schema, keys missing, fields of the wrong type
    "m-binary": (_write("meta.json", _BINARY), "meta.json is not JSON", False),
    "m-nul": (_write("meta.json", b"\0" * 64), "meta.json is not JSON", False),
    "m-not-utf8": (_write("meta.json", b'{"schema": 1, "label": "\xff\xfe"}'), "meta.json is not JSON", False),
    "m-truncated": (_write("meta.json", json.dumps(_meta("m-truncated", "dp"))[:40]), "meta.json is not JSON", False),
    "m-empty": (_write("meta.json", b""), "meta.json is not JSON", False),
    "m-deep": (_write("meta.json", "[" * 100_000), "nested too deeply", False),
    "m-list": (_write("meta.json", "[1, 2]"), "meta.json holds a list, not an object", False),
    "m-number": (_write("meta.json", "3"), "meta.json holds a number, not an object", False),
    "m-string": (_write("meta.json", '"run"'), "meta.json holds a string, not an object", False),
    "m-schema-0": (_with_meta(schema=0), "schema 0, this version reads schema 1", False),
    "m-schema-99": (_with_meta(schema=99), "schema 99", False),
    "m-schema-str": (_with_meta(schema="1"), "schema '1'", False),
    "m-schema-true": (_with_meta(schema=True), "schema True", False),
    "m-schema-float": (_with_meta(schema=1.0), "schema 1.0", False),
    "m-no-schema": (_with_meta(schema=_DROP), "schema None", False),
    "m-no-label": (_with_meta(label=_DROP), "meta.json: it has no 'label'", False),
    "m-no-run-id": (_with_meta(run_id=_DROP), "meta.json: it has no 'run_id'", False),
    "m-label-object": (_with_meta(label={"a": 1}), "label is an object, not a string", False),
    "m-world-str": (_with_meta(world_size="8"), "world_size is a string, not an integer or null", False),
    "m-world-huge": (_with_meta(world_size=10**30), "world_size is an integer too large (2**63 or more)", False),
    "m-world-object": (_with_meta(world_size={"n": 8}), "world_size is an object", False),
    "m-comparison-list": (_with_meta(comparison=[CMP]), "comparison is a list, not a string or null", False),
    "m-devices-str": (_with_meta(devices="cpu"), "devices is a string, not a list", False),
    "m-devices-ints": (_with_meta(devices=[0, 1]), "devices[0] is a number, not a string", False),
    "m-degrees-list": (_with_meta(degrees=[2, 1, 1]), "degrees is a list, not an object or null", False),
    "m-params-str": (_with_meta(num_params="1B"), "num_params is a string", False),
    "m-predicted-bad": (_with_meta(predicted={"memory": 5}), "predicted.memory is a number, not a list", False),
    # record lines: the bad ones are left out with a message, the run is shown
    "r-binary": (_write("rank00001.jsonl", _BINARY + b"\n"), "rank00001.jsonl: ", True),
    "r-nul": (_write("rank00001.jsonl", b"\0" * 100 + b"\n" + _lines(_record(1, 1, 1.0))),
              "rank00001.jsonl: 1 line(s) are not records of schema 1 (line 1 is not JSON)", True),
    "r-not-utf8": (_write("rank00001.jsonl", b'{"schema": 1, "step": 1, "note": "\xff"}\n'),
                   "rank00001.jsonl: 1 line(s) are not records", True),
    "r-not-json": (_write("rank00001.jsonl", b"hello\n{not json\n" + _lines(_record(1, 1, 1.0))),
                   "rank00001.jsonl: 2 line(s) are not records of schema 1 (line 1 is not JSON", True),
    "r-wrong-types": (_write("rank00001.jsonl", b'[1, 2]\n3\n"s"\nnull\n'),
                      "4 line(s) are not records of schema 1 (line 1: it is a list, not an object", True),
    "r-deep": (_write("rank00001.jsonl", "[" * 100_000 + "\n"), "1 line(s) are not records", True),
    "r-fields": (_write("rank00001.jsonl", _lines(_record(1, 1, 1.0, memory=[1]), _record(1, 2, "x"),
                                                  {**_record(1, 3, 1.0), "step": {"a": 1}}, _record(1, 4, 10**400))),
                 "4 line(s) are not records of schema 1 (line 1: memory is a list, not an object or null", True),
    "r-other-schema": (_write("rank00001.jsonl", _lines({**_record(1, 1, 1.0), "schema": 2})),
                       "(line 1: schema 2)", True),
    "r-truncated": (_truncated, "rank00001.jsonl end(s) in half a line", True),
    # summary.json: left out with a message (the run is shown with its steps)
    "s-binary": (_write("summary.json", _BINARY), "summary.json is not JSON", True),
    "s-truncated": (_write("summary.json", json.dumps(_summary())[:30]), "summary.json is not JSON", True),
    "s-deep": (_write("summary.json", "{" * 50_000), "summary.json is not JSON", True),
    "s-list": (_write("summary.json", "[]"), "summary.json: it holds a list, not an object", True),
    "s-losses-number": (_with_summary(losses=5), "summary.json: losses is a number, not a list", True),
    "s-losses-str": (_with_summary(losses="1.0"), "summary.json: losses is a string, not a list", True),
    "s-comm-list": (_with_summary(comm_per_step=[1]), "comm_per_step is a list, not an object", True),
    "s-comm-record": (_with_summary(comm_per_step={"all_reduce/dp": 7}), "comm_per_step.all_reduce/dp is a", True),
    "s-pipeline-list": (_with_summary(pipeline=[1]), "pipeline is a list, not an object or null", True),
    "s-pipeline-event": (_with_summary(pipeline={**PIPELINE, "timelines": {"0": [{"action": "F", "start": 0}]}}),
                         "pipeline.timelines.0[0] has no 'end'", True),
    "s-pipeline-ideal": (_with_summary(pipeline={**PIPELINE, "ideal": {"0": [["F0.0", 0, 9, 1]]}}),
                         "pipeline.ideal.0[0] has 4 items, not 3", True),
    "s-pipeline-partition": (_with_summary(pipeline={**PIPELINE, "partition": [{"stage": 0}]}),
                             "pipeline.partition[0] is an object, not a string", True),
    # names the page must show as text, not as Markdown or HTML
    "x-md-**bold**-<img src=x onerror=alert(1)>": (_incomplete, "rank00000.jsonl: 1 line(s)", True),
    "x-md-schema": (_with_meta(schema="![p](https://evil.example/p.png)"), "schema '![p](https://evil", False),
}
# Shown runs with a pipeline whose rank keys are not numbers: drawn, not an error.
ODD_PIPELINE = {**PIPELINE, "timelines": {"x": PIPELINE["timelines"]["0"], "9" * 30: PIPELINE["timelines"]["1"],
                                          "10": PIPELINE["timelines"]["0"], "2": PIPELINE["timelines"]["1"]}}


def _outside(base: Path) -> Path:
    """Files beside the store that carry SECRET: a whole run, a meta.json, a summary and a rank log."""
    outside = base / "outside"
    _run(outside / "run", SECRET, meta=_meta("run", SECRET), pipeline={**PIPELINE, "partition": [SECRET]})
    (outside / "meta.json").write_text(json.dumps(_meta("leak", SECRET)))
    (outside / "summary.json").write_text(json.dumps(_summary(pipeline={**PIPELINE, "partition": [SECRET]})))
    (outside / "secret.jsonl").write_bytes(_lines(*(_record(0, s, 4242.4242, note=SECRET) for s in (1, 2, 3))))
    return outside


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("surface")
    outside = _outside(base)
    root = base / "runs"
    _run(root / "good-single", "single")
    _run(root / "good-pp2", "pp2", 2, meta=_meta("good-pp2", "pp2", 2, degrees={"dp": 1, "tp": 1, "pp": 2}),
         pipeline=PIPELINE)
    _run(root / "good-odd-ranks", "pp2", 2, pipeline=ODD_PIPELINE)
    for name in ("...", "..a", "a..b"):  # dots in a name are a name, not a way out
        _run(root / name, "dots")
    for name, (make, _, _) in CASES.items():
        make(root / name, outside)
    return root


@pytest.fixture(scope="module")
def loaded(store):
    return data.load_runs(store)


def _ids(runs) -> list[str]:
    return [r["id"] for r in runs]


# -- the loader: a message for each case, nothing from outside ---------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_gives_its_own_message_and_the_run_is_shown_or_skipped(loaded, name):
    runs, problems = loaded
    _, message, shown = CASES[name]
    mine = [p for p in problems if p.startswith((f"{name}: ", f"Skipped: {name}: "))]
    assert mine, f"no message for {name}: {problems}"
    assert any(message in p for p in mine), mine
    assert (name in _ids(runs)) == shown
    assert all(p.startswith("Skipped: ") != shown for p in mine), mine  # skipped runs say so; shown runs don't


def test_good_runs_are_read_whole_beside_the_broken_ones(loaded):
    runs, problems = loaded
    by_id = {r["id"]: r for r in runs}
    for good in ("good-single", "good-pp2", "good-odd-ranks", "...", "..a", "a..b"):
        assert by_id[good]["status"] == "complete"
        assert not [p for p in problems if p.startswith((f"{good}:", f"Skipped: {good}:"))]
        assert [r["loss"] for r in by_id[good]["records"][0]] == LOSSES
    assert by_id["good-pp2"]["summary"]["pipeline"] == PIPELINE
    # A shown run keeps what is readable: its good lines, and its steps without the bad summary.
    assert [r["step"] for r in by_id["r-nul"]["records"][1]] == [1]
    assert [r["step"] for r in by_id["r-truncated"]["records"][1]] == [1, 2]
    assert by_id["s-losses-str"]["summary"] is None and by_id["s-losses-str"]["status"] == "complete"
    assert len(by_id["s-losses-str"]["records"][0]) == 3


def test_nothing_outside_the_store_is_read(loaded, store):
    runs, problems = loaded
    everything = repr((runs, problems))
    assert SECRET not in everything and "4242.4242" not in everything and PASSWD not in everything
    assert all(Path(r["path"]).parent == store for r in runs)


def test_the_reader_is_only_ever_given_folders_directly_in_the_store(store, monkeypatch):
    asked = []
    real = runstore.read_run
    monkeypatch.setattr(runstore, "read_run", lambda path, **kw: asked.append(Path(path)) or real(path, **kw))
    data.load_runs(store)
    assert asked and all(p.parent == store and p.name not in (".", "..") for p in asked)
    assert {p.name for p in asked} >= {"...", "..a", "a..b", "l-run-folder-link"}


def test_read_run_itself_refuses_links_not_only_the_listing(tmp_path):
    # read_run opens the folder and each file without following a link (no check-then-open window to race), so
    # a caller that skips load_runs' listing is as safe.
    outside = _outside(tmp_path)
    folder = _run(tmp_path / "runs" / "r1", world=2)
    (folder / "meta.json").unlink()
    (folder / "meta.json").symlink_to(outside / "meta.json")
    with pytest.raises(runstore.RunError, match="meta.json is not a regular file"):
        runstore.read_run(folder)
    _dir_link(tmp_path / "runs" / "r2", outside)
    with pytest.raises(runstore.RunError, match="a link, not a folder"):
        runstore.read_run(tmp_path / "runs" / "r2")


def test_every_file_is_held_to_the_loaders_size_limit(tmp_path, monkeypatch):
    folder = _run(tmp_path / "runs" / "r1", world=2)
    monkeypatch.setattr(data, "MAX_FILE_BYTES", (folder / "rank00000.jsonl").stat().st_size - 1)
    runs, problems = data.load_runs(tmp_path / "runs")
    assert not runs and "rank00000.jsonl is" in problems[0] and "over the" in problems[0]


# -- the page: every page works over the whole store ---------------------------------------------------------------


def _page_text(at: AppTest) -> str:
    return "\n".join(str(node.proto) for node in at._tree if getattr(node, "proto", None) is not None)


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def _check_page(at: AppTest, page: str) -> None:
    assert not at.exception, (page, [e.message for e in at.exception])
    text = _page_text(at)
    assert SECRET not in text and PASSWD not in text and "4242.4242" not in text, page
    warnings = [w.value for w in at.warning]
    plain = [w.replace("\\", "") for w in warnings]
    for name, (_, message, shown) in CASES.items():
        assert any(w.startswith((f"{name}: ", f"Skipped: {name}: ")) and message in w for w in plain), (page, name)
    for raw in warnings:  # names and file contents are shown as text: no image, link or HTML from a run
        assert not re.search(r"(?<!\\)[`*_\[\]<>!$~|#{}]", raw), raw
    assert any("Incomplete" in w and "x-md-**bold**" in w for w in plain), plain


def test_every_page_works_over_a_hostile_store(store, monkeypatch):
    monkeypatch.setenv(runstore.RUNS_ENV, str(store))
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    _check_page(at, "Compare")
    table = at.dataframe[0].value
    shown = [name for name, (_, _, is_shown) in CASES.items() if is_shown]
    assert set(table["run"]) == {"good-single", "good-pp2", "good-odd-ranks", "...", "..a", "a..b", *shown}
    row = table.set_index("run").loc["good-pp2"]
    assert row["strategy"] == "pp2" and row["status"] == "complete" and row["bubble"] == 0.3
    assert table.set_index("run").loc["s-binary", "status"] == "complete"
    expected = {"Memory": ["Memory per rank", "Device memory per rank", "Memory per rank, category by category"],
                "Throughput": ["Throughput"],
                "Communication": ["Communication per step"], "Loss": ["Loss against step"],
                "Pipeline": ["Measured (last step)", "The schedule's table"]}
    for page in PAGES[1:]:
        at.sidebar.radio[0].set_value(page).run()
        _check_page(at, page)
        titles = [f["layout"]["title"]["text"].split(":")[0].split(" (")[0] for f in _figures(at)]
        assert titles[:len(expected[page])] == [t.split(":")[0].split(" (")[0] for t in expected[page]], page
        assert len(titles) <= len(expected[page]) + (page == "Throughput"), titles  # + scaling, where it applies
        figures = _figures(at)
        drawn = json.dumps(figures)
        if page != "Pipeline":  # the good runs are in every chart
            assert ("good-single" in drawn or "single (1)" in drawn) and ("good-pp2" in drawn or "pp2 (2)" in drawn)
    for ending, ranks in (("#-pp2", ["rank 0", "rank 1"]),  # rank keys that are not numbers: after the others
                          ("#anks", ["rank 2", "rank 10", f"rank {'9' * 30}", "rank x"])):
        at.selectbox[0].set_value(next(o for o in at.selectbox[0].options if o.endswith(ending))).run()
        assert not at.exception, [e.message for e in at.exception]
        assert at.metric[0].value == "0.300 / 0.200" and _figures(at)[0]["data"][0]["y"] == ranks


def test_query_parameters_are_not_read_and_change_nothing(store, monkeypatch):
    source = Path(APP).read_text()
    assert "query_params" not in source and "experimental_get_query_params" not in source
    monkeypatch.setenv(runstore.RUNS_ENV, str(store))
    plain = AppTest.from_file(APP, default_timeout=120)
    plain.run()
    hostile = AppTest.from_file(APP, default_timeout=120)
    hostile.query_params.update({"run": "../outside/run", "runs": str(store.parent / "outside"), "dir": "/etc",
                                 "file": "../../outside/secret.jsonl", "page": "Pipeline", "root": "/"})
    hostile.run()
    assert not hostile.exception
    assert [w.value for w in hostile.warning] == [w.value for w in plain.warning]
    assert hostile.dataframe[0].value.equals(plain.dataframe[0].value)
    assert _figures(hostile) == _figures(plain)
    assert SECRET not in _page_text(hostile) and PASSWD not in _page_text(hostile)


# -- `stratpack dashboard`: where it listens, and XSRF ------------------------------------------------------------


@pytest.fixture
def launch(monkeypatch, tmp_path):
    """`stratpack dashboard ARGS` up to its exec: the command line and environment it would become."""
    from strategies import cli
    from strategies.cli import dashboard

    for key in [k for k in os.environ if k.startswith("STREAMLIT_")]:
        monkeypatch.delenv(key)
    calls = []
    monkeypatch.setattr(dashboard.os, "execve", lambda path, argv, env: calls.append((path, list(argv), dict(env))))

    def run(*args: str) -> tuple[list[str], dict[str, str]]:
        calls.clear()
        assert cli.main(["dashboard", "--runs-dir", str(tmp_path / "runs"), *args]) == 0
        ((path, argv, env),) = calls
        assert path == sys.executable and argv[1:4] == ["-m", "streamlit", "run"]
        return argv, env

    return run


def _flags(argv: list[str]) -> dict[str, str]:
    rest = argv[5:]  # after `python -m streamlit run app.py`
    assert len(rest) % 2 == 0 and all(k.startswith("--") for k in rest[::2]), rest
    return dict(zip(rest[::2], rest[1::2]))


def _streamlit_config(argv: list[str], env: dict[str, str], cwd: Path) -> dict:
    """The options Streamlit's own command line makes of ``argv`` in ``env`` and ``cwd`` (its config files and
    STREAMLIT_* variables included), stopping before it serves anything."""
    code = ("import json, sys\nfrom streamlit import config\nfrom streamlit.web import bootstrap, cli\n"
            "def show(*a, **k):\n"
            "    print(json.dumps({o: config.get_option(o) for o in ('server.address', 'server.enableXsrfProtection',"
            " 'server.enableCORS')}))\n    sys.exit(0)\n"
            "bootstrap.run = show\ncli.main(args=sys.argv[1:], prog_name='streamlit')\n")
    out = subprocess.run([sys.executable, "-c", code, *argv[3:]], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_it_listens_on_this_machine_only_by_default(launch, capsys, tmp_path):
    argv, env = launch()
    err = capsys.readouterr().err
    assert _flags(argv)["--server.address"] == "127.0.0.1"
    assert "warning" not in err.lower() and "http://127.0.0.1:8501" in err
    assert env[runstore.RUNS_ENV] == str((tmp_path / "runs").resolve())


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.168.1.5", ""])
def test_another_address_is_used_and_said_on_start_up(launch, capsys, address):
    argv, _ = launch("--address", address)
    assert _flags(argv)["--server.address"] == address
    warning = [line for line in capsys.readouterr().err.splitlines() if line.lower().startswith("warning")]
    assert len(warning) == 1 and f"serving on {address}" in warning[0] and "8501" in warning[0], warning


@pytest.mark.parametrize("args", [(), ("--address", "0.0.0.0")])
def test_the_command_never_turns_xsrf_or_cors_protection_off(launch, args, tmp_path):
    argv, env = launch(*args)
    flags = _flags(argv)
    for option in ("--server.enableXsrfProtection", "--server.enableCORS"):
        assert flags.get(option, "true").lower() == "true", flags
    assert not [k for k in env if k.startswith("STREAMLIT_SERVER_ENABLE")]
    home = tmp_path / "home"  # no ~/.streamlit of the machine running the tests
    options = _streamlit_config(argv, {**env, "HOME": str(home)}, ROOT)
    assert options["server.enableXsrfProtection"] is True and options["server.enableCORS"] is True
    assert options["server.address"] == (args[1] if args else "127.0.0.1")


def test_the_project_ships_no_streamlit_config_that_turns_protection_off():
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git", "runs", "node_modules", "__pycache__", ".hypothesis")]
        if Path(folder).name == ".streamlit":
            found += [Path(folder) / f for f in files]
    for path in found:
        text = path.read_text().replace(" ", "").lower()
        assert "enablexsrfprotection=false" not in text and "enablecors=false" not in text, path


@pytest.mark.parametrize("where", ["environment", "config file"])
def test_xsrf_stays_on_whatever_the_users_environment_says(launch, tmp_path, where):
    argv, env = launch()
    cwd = tmp_path / "cwd"
    (cwd / ".streamlit").mkdir(parents=True)
    if where == "environment":
        env = {**env, "STREAMLIT_SERVER_ENABLE_XSRF_PROTECTION": "false", "STREAMLIT_SERVER_ENABLE_CORS": "false"}
    else:
        (cwd / ".streamlit" / "config.toml").write_text("[server]\nenableXsrfProtection = false\nenableCORS = false\n")
    options = _streamlit_config(argv, {**env, "HOME": str(tmp_path / "home")}, cwd)
    assert options["server.enableXsrfProtection"] is True and options["server.enableCORS"] is True
