"""``metrics.jsonl`` read back (``broker_server.metrics_file.read_metrics``) and rewritten on
``--resume`` (``RunStore.keep_metrics_until``), and the run folder's whole-file writes
(``summary.json``, ``model_final.pt``): a last line a killed process left half-written is
dropped with a warning and the resume writes that round's line again (from the round's
checkpoint, which holds the line under evaluation overlap, or by running the round again); damage
anywhere else is an error naming the file and the line, with the file kept as it was. Both files
are strict JSON: a NaN or infinity is ``null``, named in the record's ``non_finite`` table."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.memory_federation import Device, federation_server, run_federation

from broker_server.errors import RunError
from broker_server.metrics_file import metrics_line, read_metrics, strict_json
from broker_server.persistence import RunStore, read_summary, write_summary
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.state import state_arrays
from protocol.memory_transport import MemoryBroker

LINES = [{"round": 1, "accuracy": 0.5, "loss": 1.25}, {"round": 2, "accuracy": 0.625, "loss": float("nan")},
         {"round": 3, "accuracy": 0.75, "loss": 0.5}]


def _write(path: Path, records: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(m) + "\n" for m in records) + tail, encoding="utf-8")


def test_read_gives_the_lines_in_order_and_skips_blank_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n\n" + json.dumps(LINES[1]) + "\n", encoding="utf-8")
    got = read_metrics(path)
    assert [m["round"] for m in got] == [1, 2] and got[0] == LINES[0] and np.isnan(got[1]["loss"])


@pytest.mark.parametrize("tail", ['{"round": 4, "accur', '{"round": 4, "accuracy": 0.8}'[:-1], "\x00\x00\x00",
                                  '{"accuracy": 0.8}'])
def test_a_last_line_cut_short_is_dropped_with_a_warning(tmp_path, caplog, tail):
    path = tmp_path / "metrics.jsonl"
    _write(path, LINES, tail)
    with caplog.at_level("WARNING"):
        got = read_metrics(path)
    assert [m["round"] for m in got] == [1, 2, 3]
    assert f"{path}:4: the last line is cut short" in caplog.text


def test_a_whole_last_line_that_is_not_a_rounds_is_damage_not_a_cut(tmp_path, caplog):
    """A last line ended by its newline was written whole: not dropped (the rewrite on resume would
    delete it), refused like any other; the cut last line warns once however often it is read."""
    path = tmp_path / "metrics.jsonl"
    _write(path, LINES[:2] + [{"round": "3", "accuracy": 0.75}])
    with pytest.raises(ValueError, match=rf"^{path}:3: expected an integer 'round', got '3'; repair or delete"):
        read_metrics(path)
    _write(path, LINES, '{"round": 4, "accur')
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert len(read_metrics(path)) == 3
    assert caplog.text.count("the last line is cut short") == 1


@pytest.mark.parametrize(("bad", "problem"), [
    ('{"round": 2, "acc', r"not valid JSON \(Unterminated string starting at\)"),
    ("[2, 0.5]", "expected a JSON object per round, got list"),
    ('{"round": "2"}', "expected an integer 'round', got '2'"),
    ('{"round": true}', "expected an integer 'round', got True"),
    ('{"round": 2, "note": "\xff"}', r"not UTF-8 text \(byte 23 of the line\)"),
    ("[" * 100_000, r"not a metrics line \(JSON nested too deeply\)"),
])
def test_damage_before_the_last_line_names_the_file_and_line(tmp_path, bad, problem):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(json.dumps(LINES[0]).encode() + b"\n" + bad.encode("latin-1") + b"\n"
                     + json.dumps(LINES[2]).encode() + b"\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: {problem}; repair or delete that line"):
        read_metrics(path)


def test_keep_metrics_until_drops_later_rounds_and_a_cut_line_and_rewrites_the_file(tmp_path):
    store = RunStore(tmp_path)
    _write(store.metrics_path, LINES, '{"round": 4, "accur')
    kept = store.keep_metrics_until(2)
    assert [m["round"] for m in kept] == [1, 2]
    assert [m["round"] for m in read_metrics(store.metrics_path)] == [1, 2]
    assert store.metrics_path.read_text(encoding="utf-8").endswith("}\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    store.close()


def test_keep_metrics_until_names_the_rounds_it_drops(tmp_path, caplog):
    """The line of a round after the checkpoint (written before that round's checkpoint, the
    round interrupted) is not dropped silently: one info line names it; nothing dropped, nothing
    said."""
    store = RunStore(tmp_path)
    _write(store.metrics_path, LINES)
    with caplog.at_level(logging.INFO, logger="broker_server.persistence"):
        store.keep_metrics_until(3)
        assert caplog.messages == []
        store.keep_metrics_until(2)
        assert caplog.messages == ["metrics.jsonl: round 3's line dropped: that round runs again after the resume"]
        caplog.clear()
        _write(store.metrics_path, LINES)
        store.keep_metrics_until(1)
        assert caplog.messages == ["metrics.jsonl: the lines of rounds 2, 3 dropped: those rounds run again after "
                                   "the resume"]
    assert [r.levelname for r in caplog.records] == ["INFO"]
    store.close()


def test_keep_metrics_until_rewrites_a_linked_file_with_its_permissions(tmp_path):
    store = RunStore(tmp_path)
    real = tmp_path / "elsewhere.jsonl"
    _write(real, LINES)
    real.chmod(0o664)  # group-writable: more than the umask (022 here) leaves a new file
    store.metrics_path.symlink_to(real)
    old_umask = os.umask(0o022)
    try:
        assert [m["round"] for m in store.keep_metrics_until(1)] == [1]
    finally:
        os.umask(old_umask)
    assert store.metrics_path.is_symlink() and [m["round"] for m in read_metrics(real)] == [1]
    assert real.stat().st_mode & 0o777 == 0o664
    store.close()


def test_keep_metrics_until_leaves_a_damaged_file_as_it_was(tmp_path):
    store = RunStore(tmp_path)
    text = json.dumps(LINES[0]) + "\nnot json\n" + json.dumps(LINES[2]) + "\n"
    store.metrics_path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        store.keep_metrics_until(1)
    assert store.metrics_path.read_text(encoding="utf-8") == text
    store.close()


def _devices(digits) -> dict[str, Device]:
    return {f"dev-{i}": Device(FedAvgClient(), digits.train.x[50 * i:50 * i + 50], digits.train.y[50 * i:50 * i + 50])
            for i in range(2)}


def test_a_resume_after_a_kill_in_the_middle_of_a_line_runs_on_from_the_checkpoint(tmp_path, digits):
    first = run_federation(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), _devices(digits), digits.test,
                           rounds=2)
    written = [dict(m) for m in read_metrics(tmp_path / "metrics.jsonl")]
    first.store.close()
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"round": 3, "accuracy": 0.')  # killed while appending round 3's line
    again = federation_server(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), digits.test, rounds=3,
                              clients=2)
    ckpt = again.checkpoints.load()
    assert ckpt is not None and ckpt.round == 2
    again.resume(ckpt)
    assert again.round == 2 and [m["round"] for m in again.metrics] == [1, 2]
    assert [m["accuracy"] for m in again.metrics] == [m["accuracy"] for m in written]
    assert [m["round"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    again.store.close()


def test_a_line_cut_short_under_evaluation_overlap_is_written_again_from_its_checkpoint(tmp_path, digits):
    """Round 1 of 2 is evaluated beside round 2 (overlap), so its checkpoint holds its line; a
    server killed while appending that line leaves half of it: the resume from round 1's
    checkpoint drops it and evaluates the checkpointed model again, the same accuracy and loss."""
    first = run_federation(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), _devices(digits), digits.test,
                           rounds=2)
    written = read_metrics(tmp_path / "metrics.jsonl")
    first.store.close()
    text = json.dumps(written[0])
    (tmp_path / "metrics.jsonl").write_text(text[:len(text) // 2], encoding="utf-8")
    again = federation_server(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), digits.test, rounds=2,
                              clients=2)
    ckpt = again.checkpoints.load(1)
    assert ckpt is not None and ckpt.meta.get("pending_line", {}).get("round") == 1
    again.resume(ckpt)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["round"] for m in lines] == [1] and "evaluate_on_resume" in lines[0]["phase_s"]
    assert (lines[0]["accuracy"], lines[0]["loss"]) == (written[0]["accuracy"], written[0]["loss"])
    again.store.close()


def test_a_resume_over_a_damaged_metrics_file_is_a_run_error_and_changes_nothing(tmp_path, digits):
    first = run_federation(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), _devices(digits), digits.test,
                           rounds=2)
    first.store.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    damaged = lines[0][:10] + "\n" + lines[1] + "\n"
    path.write_text(damaged, encoding="utf-8")
    again = federation_server(tmp_path, MemoryBroker(), FedAvg(participation_rate=1.0), digits.test, rounds=3,
                              clients=2)
    before = [np.array(a) for a in state_arrays(again.model)]
    ckpt = again.checkpoints.load()
    with pytest.raises(RunError, match=rf"^cannot resume after round 2: {path}:1: not valid JSON"):
        again.resume(ckpt)
    assert again.round == 0 and again.metrics == [] and path.read_text(encoding="utf-8") == damaged
    assert all(np.array_equal(a, b) for a, b in zip(before, state_arrays(again.model), strict=True))
    again.store.close()


def test_summary_and_final_model_are_written_whole(tmp_path, monkeypatch):
    (tmp_path / "summary.json").write_text('{"rounds_completed": 1}', encoding="utf-8")
    write_summary(tmp_path, {"rounds_completed": 3, "final_accuracy": 0.875, "strategy": {"name": "fedavg"}})
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8")) == {
        "rounds_completed": 3, "final_accuracy": 0.875, "strategy": {"name": "fedavg"}}
    import protocol.files

    def fails(src, dst):  # the rename onto summary.json fails (a full or read-only disk, a kill before it)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(protocol.files.os, "replace", fails)
    with pytest.raises(OSError, match="No space left"):
        write_summary(tmp_path, {"rounds_completed": 4})
    monkeypatch.undo()
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["rounds_completed"] == 3
    store = RunStore(tmp_path)
    model = torch.nn.Linear(3, 2)
    store.save_final_model(model)
    loaded = torch.load(tmp_path / "model_final.pt", weights_only=True)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    store.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _strict(text: str) -> object:
    """``text`` parsed as strict JSON: Python's ``json`` takes the bare ``NaN``/``Infinity``
    tokens, which RFC 8259 (and jq, JavaScript) refuse; refuse them here too."""
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_number_is_written_as_null_named_and_read_back(tmp_path):
    line = {"round": 2, "accuracy": 0.625, "loss": float("nan"), "phase_s": {"a/b~c": float("inf")},
            "alpha": [0.5, float("-inf")], "share": "all"}
    text = metrics_line(line)
    # worked out by hand: each non-finite value is null, its JSON Pointer (RFC 6901: "/" → "~1",
    # "~" → "~0") names it
    assert _strict(text) == {"round": 2, "accuracy": 0.625, "loss": None, "phase_s": {"a/b~c": None},
                             "alpha": [0.5, None], "share": "all",
                             "non_finite": {"/loss": "nan", "/phase_s/a~1b~0c": "inf", "/alpha/1": "-inf"}}
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics_line(LINES[0]) + text, encoding="utf-8")
    got = read_metrics(path)
    assert got[0] == LINES[0] and "non_finite" not in got[1]
    assert np.isnan(got[1]["loss"]) and got[1]["phase_s"] == {"a/b~c": float("inf")}
    assert got[1]["alpha"] == [0.5, float("-inf")] and got[1]["accuracy"] == 0.625
    # a finite line has no table; a line of its own "non_finite" holding a NaN is refused
    assert "non_finite" not in metrics_line(LINES[0])
    with pytest.raises(ValueError, match="may not have its own 'non_finite'"):
        strict_json({"round": 1, "loss": float("nan"), "non_finite": {}})


def test_the_server_writes_a_diverged_rounds_loss_as_strict_json(tmp_path):
    store = RunStore(tmp_path)
    for m in LINES:  # round 2's loss is NaN
        store.append_metrics(m)
    store.keep_metrics_until(2)  # the resume's rewrite keeps the form
    rows = [_strict(t) for t in store.metrics_path.read_text(encoding="utf-8").splitlines()]
    assert rows == [LINES[0], {"round": 2, "accuracy": 0.625, "loss": None, "non_finite": {"/loss": "nan"}}]
    assert np.isnan(read_metrics(store.metrics_path)[1]["loss"])
    store.close()


@pytest.mark.parametrize(("table", "problem"), [
    ('"nan"', "is not a table of JSON Pointers"),
    ('{"/loss": "NaN"}', "not a JSON Pointer to 'nan', 'inf' or '-inf'"),
    ('{"loss": "nan"}', "not a JSON Pointer"),
    ('{"/accuracy": "nan"}', "'/accuracy', which is not null"),
    ('{"/nope": "nan"}', "'/nope', which the line does not have"),
    # RFC 6901: an array index has no sign and no leading zero; "~" is only "~0" or "~1"
    ('{"/alpha/-1": "nan"}', "'/alpha/-1', which the line does not have"),
    ('{"/alpha/00": "nan"}', "'/alpha/00', which the line does not have"),
    ('{"/x~2": "nan"}', "not a JSON Pointer"),
])
def test_a_malformed_non_finite_table_is_damage(tmp_path, table, problem):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"round": 1, "accuracy": 0.5, "loss": null, "alpha": [0.5, null], "x~2": null, '
                    f'"non_finite": {table}}}\n'
                    + json.dumps(LINES[2]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"metrics.jsonl:1: .*{problem}"):
        read_metrics(path)


def test_summary_is_strict_json_with_its_nan_accuracy_given_back(tmp_path):
    # no accuracy was measured: final_accuracy NaN
    write_summary(tmp_path, {"rounds_completed": 3, "final_accuracy": float("nan"), "strategy": {"name": "fedavg"}})
    assert _strict((tmp_path / "summary.json").read_text(encoding="utf-8")) == {
        "rounds_completed": 3, "final_accuracy": None, "strategy": {"name": "fedavg"},
        "non_finite": {"/final_accuracy": "nan"}}
    got = read_summary(tmp_path)
    assert np.isnan(got["final_accuracy"]) and got["rounds_completed"] == 3 and "non_finite" not in got
    (tmp_path / "summary.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_summary(tmp_path)
