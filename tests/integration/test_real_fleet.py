"""A real fleet with the algorithms: one ``fedfleet server`` process and ``fedfleet-agent``
processes started with the very command line the server prints.

- domain-silo data (``digits_domains``, small caps) with FedPAD: the agents take the server's
  shards (size, class histogram and domain each announced at join = ``partition.json``) and every
  round completes;
- FedMCP++ with ``--param proxy_size=100`` on a 200-sample ``[data] train_samples`` subset
  (``--train-samples``): the agents given the printed ``--algorithm``/``--param``
  finish; an agent left on FedAvg is refused at join with the differing keys named, and the run
  does not wait for it;
- an agent whose join is never answered exits 5 with the likely causes; an agent handed a global
  that does not fit its algorithm's share withdraws from the round and exits 1 with a clear
  message (a scripted server channel over the embedded broker); an agent given a login in its
  ``--broker`` URL names the broker without it;
- the printed command, parsed by ``fedfleet-agent``'s own parser, announces exactly what the
  server expects (:func:`broker_server.runtime.expected_data`), for every option it prints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.brokers import require_mosquitto
from helpers.scripted_server import ScriptedServer
from helpers.waiting import wait_for

from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.runtime import expected_data
from broker_server.server_main import agent_command
from edge_agent.agent import data_announcement, param_value
from edge_agent.cli import EXIT_BROKER, EXIT_FAILED, EXIT_NOT_JOINED, build_parser
from edge_agent.cli import main as agent_main
from protocol import topics
from protocol.messages import Kind

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "FEDFLEET_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

TOML = """\
[run]
name = "{name}"
seed = 3
rounds = 2
out = "{out}"

[data]
dataset = "{dataset}"
partition = "{partition}"
clients = {clients}
{data_extra}

[train]
algorithm = "{algorithm}"
local_epochs = 1
batch_size = 16
lr = 0.05
momentum = 0.5

[algorithm]
{algorithm_table}

[server]
quorum = {clients}
round_deadline_s = 60.0
join_timeout_s = 60.0
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """One embedded broker for the module (each run has its own federation id)."""
    with EmbeddedBroker(kind="auto", workdir=tmp_path_factory.mktemp("broker")) as b:
        yield b


def _write_config(tmp: Path, **fields) -> Path:
    path = tmp / f"{fields['name']}.toml"
    path.write_text(TOML.format(out=tmp / "runs", **fields), encoding="utf-8")
    return path


def _popen(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=ENV)


def _start_server(tmp: Path, config: Path, broker_url: str, run_dir: Path) -> tuple[subprocess.Popen, list[str]]:
    """``fedfleet server`` as a process; returns it and the agent command it printed, as words."""
    log = tmp / "server.log"
    proc = _popen([sys.executable, "-m", "broker_server.cli", "server", "--config", str(config), "--broker",
                   broker_url, "--out", str(run_dir)], log, tmp)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        m = re.search(r"^  (fedfleet-agent .*)$", log.read_text(errors="replace"), re.M)
        if m:
            return proc, shlex.split(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the server printed no agent command:\n{log.read_text(errors='replace')}")


def _agent_argv(words: list[str], client_id: str, shard: int, out: Path) -> list[str]:
    """The printed command with its placeholders filled in, run as ``python -m edge_agent.cli``."""
    assert words[0] == "fedfleet-agent"
    argv = [w.replace("DEVICE_ID", client_id) for w in words[1:]]
    argv = [f"{shard}/{w.split('/')[1]}" if w.startswith("i/") else w for w in argv]
    return [sys.executable, "-m", "edge_agent.cli", *argv, "--out", str(out / client_id), "--idle-timeout-s", "90"]


def _wait(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    codes = {}
    try:
        for name, p in procs.items():
            codes[name] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        text = "\n".join(f"--- {n}\n{logs[n].read_text(errors='replace')[-3000:]}" for n in procs)
        raise AssertionError(f"a process did not finish in {timeout_s:g} s:\n{text}") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return codes


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _option(words: list[str], flag: str) -> list[str]:
    return [words[k + 1] for k, w in enumerate(words) if w == flag]


# ------------------------------------------------------------------------ the printed command


@pytest.mark.parametrize("over", [
    {"data": {"dataset": "digits_domains", "partition": "domain-silo", "clients": 3,
              "domain_clients": "usps=1, mnist=2", "domain_train_cap": 60, "domain_test_cap": 30},
     "train": {"algorithm": "fedpad"}, "algorithm": {"tau": 0.5, "fixed_alpha": True}},
    {"data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1234567, "min_samples": 4,
              "train_samples": 500, "clients": 3},
     "train": {"algorithm": "fedmcp"}, "algorithm": {"proxy_size": 100, "proxy_seed": 7}},
    {"data": {"dataset": "digits", "partition": "iid", "clients": 2}},
], ids=["domain-silo-fedpad", "dirichlet-subset-fedmcp", "iid-fedavg"])
def test_the_printed_command_announces_what_the_server_expects(over) -> None:
    raw = {"run": {"name": "t", "seed": 5, "rounds": 1}, "server": {"quorum": 1}}
    for sec, vals in over.items():
        raw.setdefault(sec, {}).update(vals)
    cfg = config_mod.from_dict(raw, "<test>")
    words = shlex.split(agent_command(cfg, "mqtt://127.0.0.1:1883", "fed-x"))
    args = build_parser().parse_args([w.replace("i/", "0/") for w in words[1:]])
    params = {k: param_value(v) for k, _, v in (p.partition("=") for p in args.param)}
    ann = data_announcement(dataset=args.dataset, partition=args.partition, alpha=args.alpha, seed=args.seed,
                            shards=int(args.shard.split("/")[1]), min_samples=args.min_samples,
                            train_samples=args.train_samples, domain_clients=args.domain_clients,
                            domain_train_cap=args.domain_train_cap, domain_test_cap=args.domain_test_cap,
                            algorithm=args.algorithm, algorithm_params=params)
    assert ann == expected_data(cfg)
    assert args.algorithm == cfg.train.algorithm
    assert params == dict(cfg.algorithm)  # every [algorithm] key, same value and type
    if cfg.data.partition == "dirichlet":
        assert args.alpha == cfg.data.alpha  # all digits (an α printed with %g would be 0.123457)


def test_the_announcement_ignores_spelling_but_not_values() -> None:
    """Two spellings of one allocation or one number read alike; another value does not."""
    base = dict(dataset="pacs", partition="domain-silo", alpha=None, seed=0, shards=4)
    a = data_announcement(**base, domain_clients="photo=3,sketch=1,cartoon=0")
    b = data_announcement(**base, domain_clients=" sketch = 1 , photo=3")
    c = data_announcement(**base, domain_clients="photo=2,sketch=2")
    assert a["domain_clients"] == b["domain_clients"] == "photo=3,sketch=1"
    assert c["domain_clients"] == "photo=2,sketch=2"
    one = dict(dataset="digits", partition="iid", alpha=None, seed=0, shards=2, algorithm="fedmcp")
    toml_side = data_announcement(**one, algorithm_params={"proxy_size": 100, "lam": 1.0, "hard": True})
    cli_side = data_announcement(**one, algorithm_params={"hard": param_value("true"), "lam": param_value("1"),
                                                          "proxy_size": param_value("100")})
    assert toml_side == cli_side
    assert toml_side["algorithm_params"] == "hard=true,lam=1.0,proxy_size=100.0"
    other = data_announcement(**one, algorithm_params={"proxy_size": 101, "lam": 1.0, "hard": True})
    assert other["algorithm_params"] != toml_side["algorithm_params"]


def test_every_agent_exit_code_is_explained_in_the_module_docstring() -> None:
    import edge_agent.cli as cli

    codes = {k: v for k, v in vars(cli).items() if k.startswith("EXIT_")}
    assert sorted(codes.values()) == [*range(6), 130]  # 130: Ctrl-C, as fedfleet server's
    for value in codes.values():
        assert f"; {value} " in cli.__doc__ or f": {value} " in cli.__doc__, value


def test_split_dataset_takes_the_subset_then_the_domain_silos() -> None:
    """``[data] train_samples`` with domain-silo: a seeded stratified subset of the whole split,
    then each domain's silo shards of that subset, mapped back to whole-split indices (composed
    here from the two documented steps)."""
    from types import SimpleNamespace

    import numpy as np

    from edge_agent.data import stratified_subsample
    from edge_agent.partition import domain_silo, split_dataset

    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 90)
    dom = np.repeat([0, 1, 2], 30)
    ds = SimpleNamespace(train=SimpleNamespace(y=y), train_domains=dom, domain_names=("a", "b", "c"))
    parts = split_dataset(ds, 3, scheme="domain-silo", seed=4, min_samples=1, train_samples=60,
                          domain_clients="c=1,a=2")
    sub = stratified_subsample(y, 60, seed=4)
    want = domain_silo(dom[sub], ("a", "b", "c"), {"a": 2, "c": 1}, seed=4, num_clients=3, min_samples=1)
    assert len(parts) == 3
    for got, w in zip(parts, want.parts):
        np.testing.assert_array_equal(got, sub[w])
    assert [set(dom[p]) for p in parts] == [{0}, {0}, {2}]
    assert sum(len(p) for p in parts) == int(np.isin(sub, np.flatnonzero(dom != 1)).sum())


# ------------------------------------------------------------------------ real processes


def test_domain_silo_fedpad_fleet_finishes_every_round(tmp_path: Path, broker) -> None:
    """(i) domain-silo + FedPAD with the printed command (clients per domain written out of the
    domains' order: the clients are numbered in domain order): shards equal the server's
    partition.json, both rounds collect both updates."""
    config = _write_config(tmp_path, name="silo", dataset="digits_domains", partition="domain-silo", clients=2,
                           data_extra='domain_clients = "usps=1,mnist=1"\ndomain_train_cap = 40\n'
                                      'domain_test_cap = 20',
                           algorithm="fedpad", algorithm_table="tau = 0.5")
    run = tmp_path / "run-silo"
    server, words = _start_server(tmp_path, config, broker.url, run)
    assert _option(words, "--partition") == ["domain-silo"]
    assert _option(words, "--domain-clients") == ["usps=1,mnist=1"]
    assert _option(words, "--algorithm") == ["fedpad"] and _option(words, "--param") == ["tau=0.5"]
    procs, logs = {"server": server}, {"server": tmp_path / "server.log"}
    for i in range(2):
        logs[f"d{i}"] = tmp_path / f"d{i}.log"
        procs[f"d{i}"] = _popen(_agent_argv(words, f"d{i}", i, tmp_path), logs[f"d{i}"], tmp_path)
    codes = _wait(procs, logs, 120)
    assert codes == {n: 0 for n in procs}, {n: logs[n].read_text()[-2000:] for n in procs}
    m = _metrics(run)
    assert [r["clients_reported"] for r in m] == [2, 2]
    shards = json.loads((run / "partition.json").read_text())["clients"]
    joined = {d["client_id"]: d for d in json.loads((run / "registry.json").read_text())["devices"]}
    assert [(s["domain"], s["samples"]) for s in shards] == [("mnist", 40), ("usps", 40)]
    for i in range(2):  # what each device announced at join = the server's shard i
        dev = joined[f"d{i}"]
        assert (dev["num_samples"], dev["class_histogram"], dev["info"]["domain"]) == \
            (shards[i]["samples"], shards[i]["histogram"], shards[i]["domain"])
        assert "trained 2 rounds, 2 updates acknowledged, finished=True" in logs[f"d{i}"].read_text()


def test_fedmcp_fleet_with_param_finishes_and_a_fedavg_agent_is_refused(tmp_path: Path, broker) -> None:
    """(ii) FedMCP++ agents with ``--param proxy_size=100`` finish both rounds; (iii) an agent
    started without ``--algorithm``/``--param`` (FedAvg) is refused at join with the keys named and
    exits 1, and no round waits for it."""
    config = _write_config(tmp_path, name="mcp", dataset="digits", partition="iid", clients=2,
                           data_extra="train_samples = 200", algorithm="fedmcp", algorithm_table="proxy_size = 100")
    run = tmp_path / "run-mcp"
    server, words = _start_server(tmp_path, config, broker.url, run)
    assert _option(words, "--algorithm") == ["fedmcp"] and _option(words, "--param") == ["proxy_size=100"]
    assert _option(words, "--train-samples") == ["200"]
    wrong = [w for k, w in enumerate(words) if w not in ("--algorithm", "--param")
             and words[k - 1] not in ("--algorithm", "--param")]
    procs, logs = {"server": server}, {"server": tmp_path / "server.log"}
    logs["wrong"] = tmp_path / "wrong.log"
    procs["wrong"] = _popen(_agent_argv(wrong, "wrong", 0, tmp_path), logs["wrong"], tmp_path)
    for i in range(2):
        logs[f"d{i}"] = tmp_path / f"d{i}.log"
        procs[f"d{i}"] = _popen(_agent_argv(words, f"d{i}", i, tmp_path), logs[f"d{i}"], tmp_path)
    codes = _wait(procs, logs, 120)
    assert codes == {"server": 0, "wrong": EXIT_FAILED, "d0": 0, "d1": 0}, \
        {n: logs[n].read_text()[-2000:] for n in procs}
    # the refused agent was never selected, so every round closed on the two reports (quorum 2)
    # instead of waiting out its 60 s deadline
    assert [(m["clients_selected"], m["clients_reported"]) for m in _metrics(run)] == [(2, 2), (2, 2)]
    refused = logs["wrong"].read_text()
    assert "refused the join" in refused
    assert "algorithm 'fedavg' (server: 'fedmcp')" in refused
    assert "algorithm_params '' (server: 'proxy_size=100.0')" in refused
    assert "Traceback" not in refused
    assert [r["clients_reported"] for r in _metrics(run)] == [2, 2]
    shards = json.loads((run / "partition.json").read_text())["clients"]
    joined = {d["client_id"]: d for d in json.loads((run / "registry.json").read_text())["devices"]}
    assert set(joined) == {"d0", "d1"} and sum(s["samples"] for s in shards) == 200
    for i in range(2):  # shards of the 200-sample subset
        assert (joined[f"d{i}"]["num_samples"], joined[f"d{i}"]["class_histogram"]) == \
            (shards[i]["samples"], shards[i]["histogram"])
        assert "trained 2 rounds, 2 updates acknowledged, finished=True" in logs[f"d{i}"].read_text()


# ------------------------------------------------------------ agents against a scripted server


def _agent(broker, fed: str, tmp: Path, *extra: str) -> list[str]:
    return ["--broker", broker.url, "--federation", fed, "--client-id", "dev-1", "--dataset", "digits",
            "--shard", "0/2", "--seed", "3", "--out", str(tmp / "dev-1"), *extra]


def test_an_unanswered_join_exits_5_with_the_likely_causes(tmp_path: Path, broker, capsys) -> None:
    """The server drops the join (as a signing server drops a device it has not enrolled) but ends
    the run: before, the agent said "trained 0 rounds … finished=True" and exited 0."""
    srv = ScriptedServer(broker.port, "fed-silent", "silent")
    try:
        code = agent_main(_agent(broker, "fed-silent", tmp_path))
    finally:
        srv.close()
    cap = capsys.readouterr()
    err = cap.err
    assert code == EXIT_NOT_JOINED == 5
    assert "never acknowledged the join" in err and "the federation finished" in err
    assert "finished=True" not in cap.out  # not a run this device took part in
    assert "not enrolled" in err and "--server-pubkey" in err and "--federation" in err


def test_an_agent_names_its_broker_without_the_login_its_url_carries(tmp_path: Path, capsys) -> None:
    """``--broker mqtt://USER:PASSWORD@HOST:PORT``: the agent logs in with them, and its lines (and
    its ledger folder) name the broker as ``mqtt://HOST:PORT``."""
    require_mosquitto()  # a broker that takes any user name and password (amqtt's may not)
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as b:
        code = agent_main(["--broker", f"mqtt://fleet-op:s3cr%40t@127.0.0.1:{b.port}", "--federation", "fed-login",
                           "--client-id", "dev-1", "--dataset", "digits", "--shard", "0/2", "--seed", "3",
                           "--out", str(tmp_path / "dev-1"), "--join-timeout-s", "0.5"])
    out, err = capsys.readouterr()
    assert code == EXIT_NOT_JOINED  # connected (logged in), nobody answered its join
    assert f"joining federation 'fed-login' on {b.url} (idle timeout 3600 s)\n" in out
    said = [text for text in (out, err) if "fleet-op" in text or "s3cr" in text]
    assert said + [p.name for p in (tmp_path / "dev-1").rglob("*") if p.is_file() and b"s3cr" in p.read_bytes()] == []


def test_no_server_at_all_exits_5_after_the_idle_timeout(tmp_path: Path, broker, capsys) -> None:
    code = agent_main(_agent(broker, "fed-nobody", tmp_path, "--idle-timeout-s", "1"))
    err = capsys.readouterr().err
    assert code == EXIT_NOT_JOINED
    assert "nothing from the server for 1 s" in err and "never acknowledged the join" in err


def test_a_join_never_answered_exits_5_after_the_join_timeout(tmp_path: Path, broker, capsys) -> None:
    """Nobody answers and nobody ends the run: the agent gives up after --join-timeout-s, long
    before its idle timeout."""
    code = agent_main(_agent(broker, "fed-unheard", tmp_path, "--join-timeout-s", "1.5"))
    err = capsys.readouterr().err
    assert code == EXIT_NOT_JOINED
    assert "no answer to its join within 1.5 s" in err and "never acknowledged the join" in err


#: ``python -c`` of a ``fedfleet-agent`` process whose MQTT transport does, with its first join,
#: what argv[1] says: ``wait-ends`` publishes it, then its wait ends before the PUBACK
#: (PublishTimeout, the handle set: a slow link); ``not-taken`` takes nothing (the transport closed
#: under it). The rest of argv is the agent's.
_STALLING_AGENT = """
import sys
from protocol.errors import PublishTimeout, TransportError
from protocol.transport import MqttTransport
from edge_agent.cli import main

how, real, joins = sys.argv[1], MqttTransport.publish, []

def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
    if not topic.endswith("/join") or joins:
        return real(self, topic, payload, qos=qos, retain=retain, wait_s=wait_s)
    joins.append(topic)
    if how == "not-taken":
        raise TransportError(f"{self.client_id}: PUBLISH to {topic} ({len(payload):,} bytes) not sent: the "
                             "transport is closed", client_id=self.client_id, topic=topic)
    info = real(self, topic, payload, qos=qos, retain=retain)
    raise PublishTimeout(f"{self.client_id}: PUBLISH to {topic} not acknowledged within 30 s (it stays queued: "
                         "its outcome comes later)", client_id=self.client_id, topic=topic, handle=info)

MqttTransport.publish = publish
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("how", ["wait-ends", "not-taken"])
def test_a_first_join_the_link_stalls_or_refuses_never_ends_the_agent_in_a_traceback(tmp_path: Path, broker,
                                                                                       how: str) -> None:
    """A ``fedfleet-agent`` process. ``wait-ends``: its first join's wait for the PUBACK ends first
    (a slow link): the join is queued, taken as not answered yet (a WARNING says so), and reaches
    the scripted server, which ends the run without answering it: exit 5, as any unanswered join.
    ``not-taken``: the transport takes no join (closed under it): the run cannot go on; the agent
    says so in one line, ``broker link error: …``, and exits 4. Before, both ended in a Python
    traceback (an uncaught PublishTimeout / TransportError, exit 1)."""
    fed = f"fed-stall-{how}"
    srv = ScriptedServer(broker.port, fed, "silent") if how == "wait-ends" else None
    try:
        proc = subprocess.run([sys.executable, "-c", _STALLING_AGENT, how, *_agent(broker, fed, tmp_path)],
                              cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    finally:
        if srv is not None:
            srv.close()
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("fedfleet-agent:")]
    join_topic = topics.up(fed, "dev-1", Kind.JOIN)
    if how == "wait-ends":
        assert proc.returncode == EXIT_NOT_JOINED == 5, err[-3000:]
        assert (f"dev-1: its join (seq 2) is not acknowledged by the broker yet ({fed}:dev-1: PUBLISH to {join_topic} "
                "not acknowledged within 30 s (it stays queued: its outcome comes later)): it stays queued and goes "
                "out as the link moves; waiting for the server's answer to it") in err
        assert len(said) == 1 and "never acknowledged the join of dev-1" in said[0] and "federation finished" in said[0]
    else:
        assert proc.returncode == EXIT_BROKER == 4, err[-3000:]
        assert len(said) == 1 and re.fullmatch(
            rf"fedfleet-agent: broker link error: {re.escape(f'{fed}:dev-1: PUBLISH to {join_topic}')} "
            r"\([0-9,]+ bytes\) not sent: the transport is closed", said[0]), said


def test_a_global_that_does_not_fit_the_algorithm_stops_the_agent_clearly(tmp_path: Path, broker, capsys) -> None:
    """A FedAvg device (8 tensors) handed a 0-tensor global: it withdraws from round 1 (so the
    server need not wait for the deadline), says offline, and exits 1 naming the algorithm."""
    srv = ScriptedServer(broker.port, "fed-mismatch", "mismatch")
    try:
        code = agent_main(_agent(broker, "fed-mismatch", tmp_path))
        # its offline status on its way through the broker to the scripted server
        wait_for(lambda: bool(srv.statuses) and srv.statuses[-1][1] == "offline", 30)
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "does not fit this device's algorithm 'fedavg' (share='all')" in err
    assert "0 tensors received, the model has 8" in err and "--algorithm" in err
    assert "Traceback" not in err
    idle = [s for s in srv.statuses if s[1] == "idle"]
    assert len(idle) == 1 and idle[0][0] == 1 and "does not fit" in idle[0][2]
    assert srv.statuses[-1][1] == "offline"


def test_a_scaffold_agent_killed_and_restarted_carries_on_from_its_kept_state(tmp_path: Path, broker) -> None:
    """A real SCAFFOLD fleet (server and two agents as processes, the printed command): agent d1
    is killed (SIGKILL) once the server accepted its round-1 update and it wrote that state, and
    started again with the same command; it carries on from its state file
    (``OUT/device_state-<federation>.sqlite``), so after round 3 the server's c is still the mean
    of the devices' c_i (SCAFFOLD's invariant, broker_server/strategies/scaffold.py). A device
    that restarted at c_i = 0 would leave c holding its old contribution."""
    from broker_server.checkpoint import CheckpointStore
    from edge_agent.state_store import DeviceStateStore

    config = _write_config(tmp_path, name="scaf", dataset="digits", partition="iid", clients=2, data_extra="",
                           algorithm="scaffold", algorithm_table="").read_text(encoding="utf-8")
    config = config.replace("rounds = 2", "rounds = 3")
    (tmp_path / "scaf.toml").write_text(config, encoding="utf-8")
    run = tmp_path / "run-scaf"
    server, words = _start_server(tmp_path, tmp_path / "scaf.toml", broker.url, run)
    fed = _option(words, "--federation")[0]
    procs, logs = {"server": server}, {"server": tmp_path / "server.log"}
    for i in range(2):
        logs[f"d{i}"] = tmp_path / f"d{i}.log"
        procs[f"d{i}"] = _popen(_agent_argv(words, f"d{i}", i, tmp_path), logs[f"d{i}"], tmp_path)
    state_file = tmp_path / "d1" / f"device_state-{fed}.sqlite"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # d1 has read the server's acceptance of its round-1 update
        if state_file.exists():
            s = DeviceStateStore(state_file)
            done = 1 in s.rounds("d1")
            s.close()
            if done:
                break
        assert procs["d1"].poll() is None, logs["d1"].read_text()[-2000:]
        time.sleep(0.05)
    else:
        raise AssertionError("d1 never kept a settled round-1 state:\n" + logs["d1"].read_text()[-2000:])
    # the server is held (SIGSTOP) while d1 is down, so that it neither finishes the run without
    # it nor starts a round for d0 alone: the restarted d1 takes part in the rounds that follow
    os.kill(server.pid, signal.SIGSTOP)
    try:
        procs["d1"].kill()
        procs["d1"].wait(timeout=30)
        logs["d1b"] = tmp_path / "d1b.log"
        procs["d1b"] = _popen(_agent_argv(words, "d1", 1, tmp_path), logs["d1b"], tmp_path)
        procs.pop("d1")
        deadline = time.monotonic() + 90
        while "carries on from" not in logs["d1b"].read_text(errors="replace") and time.monotonic() < deadline:
            assert procs["d1b"].poll() is None, logs["d1b"].read_text()[-2000:]
            time.sleep(0.1)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    codes = _wait(procs, logs, 180)
    assert codes == {n: 0 for n in procs}, {n: logs[n].read_text()[-2000:] for n in procs}
    text = logs["d1b"].read_text()
    carried = int(re.search(r"carries on from the state it kept after round (\d+)", text).group(1))
    assert carried in (1, 2)  # round 1's, or round 2's when its answer came just before the kill
    assert [r["round"] for r in _metrics(run)] == [1, 2, 3]
    store = CheckpointStore(run / "checkpoints.sqlite")
    final = store.load(3).strategy_state
    store.close()
    assert int(final["clients_seen"]) == 2
    devices = []
    for d in ("d0", "d1"):
        s = DeviceStateStore(tmp_path / d / f"device_state-{fed}.sqlite")
        rnd, arrays = s.newest(d)
        s.close()
        assert rnd == 3  # each device's state after its accepted round-3 update
        devices.append(arrays["control"])
    c = np.asarray(final["control"], np.float64)
    assert np.abs(c).max() > 1e-4
    np.testing.assert_allclose(c, np.mean(devices, axis=0), rtol=0, atol=1e-6)
