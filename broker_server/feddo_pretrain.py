"""``fedfleet feddo pretrain``: FedDO's offline pre-training episodes in an in-process simulation.

SPECS §4.3 [guess, modelled on FedAA]: an episode is one FL run from a freshly initialised
global model (seed ``[run] seed + episode``), ``rounds`` rounds long, with the configured data,
partition, model and training settings; the last transition of an episode has done = 1. The
FedDO strategy and client half run exactly as in a federation (``configure_round`` → each asked
device's ``local_round`` on its shard → ``validate`` → ``aggregate`` → commit → ``evaluate``), but
in one process without a broker, so an episode costs only the training. The agent and its replay
buffer carry over from episode to episode; at the end the policy is written with
:meth:`~broker_server.rl.dsac_t.DSACTAgent.save_policy` (metadata: device count, state layout,
episodes, rounds, data settings, CPU seconds) and a deployed run loads it with
``[algorithm] policy = "PATH"``.

After each whole episode the agent, its replay buffer and random streams, the episodes' lines and
the CPU time so far go to a progress file beside the policy (:func:`progress_path`); the same
command, run again after a stop (Ctrl-C, SIGTERM, a kill, a power cut), goes on after the last
whole episode, and its policy has the bits of one pre-training run straight through. The file is
removed once the policy is written; one made with other settings is refused, naming them.

The agent starts from the policy the configuration's ``[algorithm] policy`` names, when it names
one (its networks, optimisers and temperature; the replay buffer starts empty), else untrained;
``--from-scratch`` ignores that key. The first line says which (:func:`banner_text`), and the
written metadata's ``started_from*`` keys record the starting policy, so that ``updates``
(counted from the start of the agent) is not read as this pre-training's alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import msgpack
import numpy as np
import torch

from edge_agent.algorithms import TrainConfig, shared_arrays
from edge_agent.data import load_dataset
from edge_agent.state import load_arrays
from protocol.files import remove_stale_temporaries, write_atomically
from protocol.lifecycle import atomic

from .checkpoint import pack_state, unpack_state
from .config import Config
from .errors import ConfigError, RunError
from .runtime import check_fleet_size, data_settings, device_model, make_client_algorithm, make_strategy, train_config
from .simulate import split_clients
from .strategies import ClientResult, apply_update
from .strategies.feddo import GLOBAL_FEATURES, FedDO
from .text import plural

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainResult:
    """What :func:`pretrain` did.

    Attributes:
        policy: the written policy file.
        episodes: lines per episode (``episode``, ``final_accuracy``, ``return``, ``mean_active``,
            ``mean_ratio``, ``replay``, ``alpha``: the entropy temperature at the episode's end,
            ``updates``: DSAC-T updates so far, ``seconds``; once the agent has updated, ``q_mean``
            and ``entropy`` of its last update: :meth:`~broker_server.rl.dsac_t.DSACTAgent.update`).
        cpu_seconds: process CPU time of the whole pre-training (``time.process_time``), the
            runs before a resume included.
        parameter_counts: the agent's :meth:`~broker_server.rl.dsac_t.DSACTAgent.parameter_counts`.
        resumed_after: the whole episodes a progress file held at each resume (``()``: one run).
    """

    policy: Path
    episodes: list[dict]
    cpu_seconds: float
    parameter_counts: dict[str, int]
    resumed_after: tuple[int, ...] = ()


@dataclass(frozen=True)
class StartingPoint:
    """Where a pre-training's agent starts (:func:`pretrain`'s ``on_start``, :func:`banner_text`).

    Attributes:
        policy: the configuration's ``[algorithm] policy`` as it gives it (``""``: none).
        loaded: whether the agent was loaded from it (``False``: untrained, with or without
            ``--from-scratch``).
        updates: the DSAC-T updates the loaded policy had made, all its pre-trainings together
            (0 untrained).
        sha256: the loaded file's SHA-256 (``""`` untrained).
        resumed_after: the whole episodes of the progress file this pre-training goes on from
            (0: none; :func:`progress_path`).
        progress: that file's path (``""``: none).
    """

    policy: str = ""
    loaded: bool = False
    updates: int = 0
    sha256: str = ""
    resumed_after: int = 0
    progress: str = ""


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether the paths ``a`` and ``b`` name one file (both there: :func:`os.path.samefile`, so
    a second name of it, a link, counts; else the same absolute path)."""
    try:
        if Path(a).exists() and Path(b).exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(a).absolute() == Path(b).absolute()


def banner_text(cfg: Config, episodes: int, rounds: int, out: Path, start: StartingPoint) -> str:
    """The first line of ``fedfleet feddo pretrain``: data set, devices, episodes x rounds, the
    agent it starts from (a policy, named with its updates, or an untrained agent), the file it
    writes (said to be replaced when it is the starting policy's file) and, on a resume, the
    episode it goes on after and its progress file."""
    if start.loaded:
        origin = (f"starting from the policy {start.policy} (the config's [algorithm] policy; its "
                  f"{plural(start.updates, 'DSAC-T update')}; --from-scratch ignores it)")
    elif start.policy:
        origin = f"from an untrained agent (--from-scratch: the config's [algorithm] policy {start.policy} is not read)"
    else:
        origin = "from an untrained agent"
    replaced = (" (the starting policy's file: replaced when the pre-training ends, whole or not at all)"
                if start.loaded and same_file(out, start.policy) else "")
    resumed = (f"; resuming after episode {start.resumed_after} of {episodes} (the progress file {start.progress}; "
               "delete it to start over)" if start.resumed_after else "")
    return (f"fedfleet feddo pretrain: {cfg.data.dataset}, {plural(cfg.data.clients, 'device')}, "
            f"{plural(episodes, 'episode')} x {plural(rounds, 'round')}, {origin} -> {out}{replaced}{resumed}")


def replay_batch_note(cfg: Config, episodes: int, rounds: int) -> str | None:
    """What a replay batch larger than the buffer does, said before the first episode (``None``
    when ``[algorithm] batch_size`` is at most ``warmup``, the buffer's size at the first update).
    A DSAC-T update draws its ``batch_size`` transitions uniformly *with replacement*
    (:meth:`~broker_server.rl.dsac_t.ReplayBuffer.sample`), so a batch larger than the buffer
    repeats transitions; where the whole pre-training stores fewer (``episodes × rounds``: one a
    round, a starting policy's buffer not carried over), every update does."""
    defaults = feddo_defaults()
    batch = int(cfg.algorithm.get("batch_size", defaults["batch_size"]))
    warmup = max(1, int(cfg.algorithm.get("warmup", defaults["warmup"])))
    total = episodes * rounds
    if batch <= warmup:
        return None
    if total < batch:
        return (f"fedfleet feddo pretrain: note: [algorithm] batch_size = {batch} is more than the {total} "
                "transitions this pre-training stores in all (--episodes x --rounds): every DSAC-T update draws its "
                f"{batch} from at most {total}, with replacement (each one about {batch / total:.0f} times in every "
                "batch); lower batch_size, or pre-train more rounds")
    return (f"fedfleet feddo pretrain: note: [algorithm] batch_size = {batch} is more than warmup = {warmup}: the "
            f"DSAC-T updates before the replay buffer holds {batch} transitions draw their batch from fewer, with "
            f"replacement (the first from {warmup})")


#: what each column of :func:`progress_line` is (printed once, above the first episode's line)
PROGRESS_LEGEND = (
    "columns: accuracy = the global model's validation accuracy after the episode's last round; return = the "
    "episode's summed reward; active = devices with d > 0 per round (mean); ratio = their mean d; replay = "
    "transitions stored; alpha = the entropy temperature (starts at e, falls while the policy's entropy is above "
    "its target -K); Q = the critics' mean Q on the last update's batch (the return to come plus alpha x entropy a "
    "round, so large while the entropy is; one growing by orders of magnitude is a critic diverging); entropy = "
    "-mean log pi of the actions in (-1, 1)^K (at most K ln 2 = {top:.3g}: a random policy; target -K = {target}). "
    "Q and entropy appear once the agent has updated (replay >= warmup = {warmup}).")


def progress_line(m: dict, episodes: int) -> str:
    """One episode's progress line."""
    return (f"episode {m['episode']:>3}/{episodes}  accuracy {m['final_accuracy']:.4f}  return {m['return']:+.3f}  "
            f"active {m['mean_active']:.1f}  ratio {m['mean_ratio']:.3f}  replay {m['replay']}"
            + (f"  alpha {m['alpha']:.3g}" if "alpha" in m else "")
            + (f"  Q {m['q_mean']:.4g}" if "q_mean" in m else "")
            + (f"  entropy {m['entropy']:.4g}" if "entropy" in m else "") + f"  {m['seconds']:.1f} s")


#: the progress file's format (a file of a newer one is refused, not misread)
PROGRESS_FORMAT = 1
#: the progress settings' key of the starting policy: its SHA-256 (``""``: an untrained agent)
STARTING_POLICY = "starting policy (SHA-256)"


def progress_path(out: str | Path) -> Path:
    """Where a pre-training writing its policy to ``out`` keeps its progress between episodes:
    ``NAME.progress`` beside it (msgpack: its format, the SHA-256 of its state and the state: the
    settings it was made with, the whole episodes' lines, the CPU seconds so far, the resumes, and
    the FedDO strategy's ``state_dict()``: agent networks, optimisers, temperature, random streams
    and replay buffer)."""
    out = Path(out)
    return out.with_name(f"{out.name}.progress")


def progress_settings(cfg: Config, rounds: int, start: StartingPoint) -> dict:
    """What a progress file must have been made with to be gone on from: the ``[data]`` (but
    ``data_dir``: where the files are), ``[model]``, ``[train]`` and ``[algorithm]`` tables (but
    ``policy``: the starting policy counts by its SHA-256), ``[run] seed``, the rounds per episode
    and the starting policy's SHA-256 (``""``: untrained). The episodes are not in it: a
    pre-training may be resumed with more (each episode is its own seed, ``seed + episode``)."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k != "data_dir"}
    algorithm = {k: v for k, v in cfg.algorithm.items() if k != "policy"}
    settings = {"data": data, "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
                "algorithm": algorithm, "run": {"seed": cfg.run.seed}, "--rounds": rounds,
                STARTING_POLICY: start.sha256 if start.loaded else ""}
    return json.loads(json.dumps(settings))  # as msgpack gives it back: tuples as lists


def read_progress(path: Path) -> dict | None:
    """The progress file at ``path`` (``None``: there is none).

    Raises:
        ConfigError: it cannot be read (truncated, not a progress file, a newer format, damaged:
            its checksum does not match, or its content is not of a pre-training), naming it and
            saying to delete it to start over.
    """
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"the pre-training's progress file {path} cannot be read ({exc})") from exc
    try:
        outer = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        if not isinstance(outer, dict) or "format" not in outer:
            raise ValueError("not a FedDO pre-training progress file")
        if int(outer["format"]) > PROGRESS_FORMAT:
            raise ValueError(f"format {outer['format']}, newer than this fedfleet's {PROGRESS_FORMAT}")
        body = outer.get("state")
        if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
            raise ValueError("its checksum does not match its content: the file is damaged")
        state = msgpack.unpackb(body, raw=False, strict_map_key=False)
        kinds: dict[str, tuple[type, ...]] = {"settings": (dict,), "lines": (list,), "cpu_seconds": (int, float),
                                              "resumed_after": (list,), "strategy": (dict,)}
        for key, kind in kinds.items():
            if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
                raise ValueError(f"its {key!r} is missing or not a {' or '.join(k.__name__ for k in kind)}")
        if not all(isinstance(line, dict) for line in state["lines"]) or not state["strategy"].get("agent"):
            raise ValueError("its episodes' lines or its agent are not those of a pre-training")
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ConfigError(f"the pre-training's progress file {path} cannot be read ({exc}): delete it to start "
                          "over") from exc
    return state


def read_progress_episodes(path: Path) -> int:
    """The whole episodes the progress file at ``path`` holds (0: none, or it cannot be read).
    It reads the whole file (about 90 MB for a 1,024-wide agent's replay buffer):
    :func:`pretrain` asks it only when a stop came during a progress write, where the file may
    hold the episode before or the one just written."""
    try:
        state = read_progress(path)
    except ConfigError:
        return 0
    return len(state["lines"]) if state else 0


def _differences(saved: object, now: object, where: str = "") -> list[str]:
    """``key: A in the progress file, B now`` for each value that differs (nested tables by dots)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out: list[str] = []
        for k in sorted(set(saved) | set(now)):
            out += _differences(saved.get(k, "(absent)"), now.get(k, "(absent)"), f"{where}.{k}" if where else k)
        return out
    if saved == now:
        return []
    if where == STARTING_POLICY:  # "" is an untrained agent (no policy, or --from-scratch)
        saved, now = (repr(v) if v else "an untrained agent" for v in (saved, now))
        return [f"{where}: {saved} in the progress file, {now} now"]
    return [f"{where}: {saved!r} in the progress file, {now!r} now"]


def _policy_metadata(path: Path) -> dict:
    """The metadata of the policy file at ``path`` (``{}``: none there, or not a policy)."""
    try:
        meta = torch.load(path, weights_only=True, map_location="cpu").get("metadata")
    except Exception:  # noqa: BLE001 - absent, not a policy: it says nothing about the progress file
        return {}
    return meta if isinstance(meta, dict) else {}


def check_progress(saved: dict, settings: dict, path: Path, episodes: int, *, out: Path | None = None) -> None:
    """Refuse to go on from a progress file made with other settings (:func:`progress_settings`)
    or holding more whole episodes than ``episodes``. Where the policy at ``out`` is the finished
    policy of that very pre-training (its whole episodes, from its starting policy: a stop after
    the policy was written and before the progress file was removed; its file the starting
    policy, it now differs from the one the progress file started from), that is said instead.

    Raises:
        ConfigError: naming the file, each setting that differs (at most 5) or the episodes, and
            what to do.
    """
    diff = _differences(saved["settings"], settings)
    start = saved["settings"].get(STARTING_POLICY, "")
    meta = _policy_metadata(out) if out is not None and out.exists() else {}
    if (diff and meta and "interrupted_episode" not in meta and meta.get("episodes") == len(saved["lines"])
            and meta.get("started_from_sha256", "") == start):
        raise ConfigError(f"{out} is already the finished policy of the pre-training in the progress file {path} "
                          f"({len(saved['lines'])} episodes; the process stopped after writing it, before removing "
                          f"the progress file): delete {path}, then run the command again to pre-train further from "
                          f"{out}")
    if diff:
        more = f" (and {len(diff) - 5} more)" if len(diff) > 5 else ""
        raise ConfigError(f"the progress file {path} holds {plural(len(saved['lines']), 'whole episode')} of a "
                          f"pre-training with other settings: {'; '.join(diff[:5])}{more}. Run it with its settings to "
                          "go on, or delete the file to start over")
    if len(saved["lines"]) > episodes:
        raise ConfigError(f"the progress file {path} holds {len(saved['lines'])} whole episodes, more than --episodes "
                          f"{episodes}: give --episodes {len(saved['lines'])} or more to go on, or delete the file to "
                          "start over")


def write_progress(path: Path, settings: dict, lines: list[dict], cpu_seconds: float, resumed_after: list[int],
                   strategy: FedDO) -> None:
    """Write the progress after a whole episode, atomically and flushed to the disk (a stop or a
    power cut leaves the last whole one)."""
    body = msgpack.packb({"settings": settings, "lines": lines, "cpu_seconds": cpu_seconds,
                          "resumed_after": resumed_after, "strategy": pack_state(strategy.state_dict())},
                         use_bin_type=True)
    blob = msgpack.packb({"format": PROGRESS_FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "state": body},
                         use_bin_type=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, blob, mode=0o600, fsync=True)


def pretrain(cfg: Config, *, episodes: int, rounds: int, out: str | Path,
             on_episode: Callable[[dict], None] | None = None,
             on_start: Callable[[StartingPoint], None] | None = None,
             on_interrupt: Callable[[str], None] | None = None, from_scratch: bool = False) -> PretrainResult:
    """Run ``episodes`` pre-training episodes of ``rounds`` rounds and write the policy to ``out``.

    Args:
        cfg: a configuration whose ``[train] algorithm`` is ``"feddo"`` (its ``[algorithm]``
            table sets the agent; a ``policy`` there is the starting point unless ``from_scratch``).
        episodes, rounds: ≥ 1.
        out: the policy file to write.
        on_episode: called with each episode's line.
        on_start: called with the agent's :class:`StartingPoint` once the configuration checks
            below have passed and the data set is loaded, just before the first episode
            (``fedfleet feddo pretrain`` prints its banner there, so a configuration error comes
            alone; a ``[model]`` that does not fit the data still fails in episode 1).
        on_interrupt: called with one line when Ctrl-C (KeyboardInterrupt) or SIGTERM
            (SystemExit) stops the pre-training, after the policy learned so far is written
            (:func:`_save_interrupted`; ``None``: logged as a warning); the stop is then re-raised.
            The progress file keeps the whole episodes: the same call goes on after them
            (:func:`progress_path`; ``on_start``'s :class:`StartingPoint` says from where).
        from_scratch: start from an untrained agent even where ``[algorithm] policy`` names a
            policy (not read).

    Raises:
        ConfigError: another algorithm, episodes or rounds below 1, an ``out`` that cannot be
            written (:func:`check_policy_out`, before any training), a partition that cannot be
            made, a starting ``policy`` trained for fewer devices than ``[data] clients``
            (:func:`~broker_server.runtime.check_fleet_size`, before any training), ``[algorithm]
            num_devices`` below ``[data] clients``, a pre-training that would never update the
            agent (:func:`check_learns`), a progress file that cannot be read, was made with other
            settings or holds more episodes than ``episodes`` (:func:`check_progress`).
        DataError: the data set cannot be found.
        RunError: the policy could not be written (a full disk: the file there before is left as
            it was) or its agent diverged to NaN; nothing is written.
    """
    if cfg.train.algorithm != "feddo":
        raise ConfigError(f"fedfleet feddo pretrain needs [train] algorithm = \"feddo\", not {cfg.train.algorithm!r}")
    if episodes < 1 or rounds < 1:
        raise ConfigError(f"--episodes ({episodes}) and --rounds ({rounds}) must be >= 1")
    check_policy_out(Path(out))
    check_learns(cfg, episodes, rounds)
    given = str(cfg.algorithm.get("policy") or "")
    if from_scratch and given:
        cfg = dataclasses.replace(cfg, algorithm={**cfg.algorithm, "policy": ""})
    start = StartingPoint(policy=given)
    cpu0 = time.process_time()
    strategy: FedDO | None = None
    lines: list[dict] = []
    resumed_after: list[int] = []
    written = 0  # the whole episodes of the last progress write (or of the progress file resumed)
    r = 0
    progress = progress_path(out)
    try:
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir or None)
        parts = split_clients(ds, cfg)
        built = make_strategy(cfg, ds)
        if not isinstance(built, FedDO):
            raise ConfigError("[train] algorithm 'feddo' did not build the FedDO strategy")
        strategy = built
        if strategy.policy_record and strategy.agent is not None:
            start = StartingPoint(given, True, int(strategy.agent.updates),
                                  str(strategy.policy_record.get("file_sha256", "")))
        check_fleet_size(cfg, strategy)
        k = int(cfg.algorithm.get("num_devices") or 0)
        if k and cfg.data.clients > k:
            raise ConfigError(
                f"{cfg.source}: [algorithm] num_devices = {k} but [data] clients = {cfg.data.clients}: the policy "
                f"would be {k} devices wide, {cfg.data.clients - k} devices would never be asked in pre-training, and "
                f"this configuration's fleet could not run it; set num_devices = {cfg.data.clients} (or 0: the "
                f"fleet's size) or clients = {k}")
        ids = [f"dev-{i:03d}" for i in range(len(parts))]
        shards = [(torch.from_numpy(np.ascontiguousarray(ds.train.x[p])), torch.from_numpy(np.asarray(ds.train.y[p])))
                  for p in parts]
        for cid, (_, y) in zip(ids, shards, strict=True):
            strategy.on_join(cid, "x86-cpu", int(y.shape[0]))
        client = make_client_algorithm(cfg, ds)
        base = TrainConfig.from_mapping(TrainConfig(seed=cfg.run.seed), train_config(cfg))
        cpu = torch.device("cpu")
        settings = progress_settings(cfg, rounds, start)
        for tmp in remove_stale_temporaries(progress):  # a kill between a progress write and its rename
            log.info("FedDO pre-training: removed %s, a progress write a killed process left", tmp)
        saved = read_progress(progress)
        if saved is not None:  # go on after its last whole episode
            check_progress(saved, settings, progress, episodes, out=Path(out))
            try:
                strategy.load_state_dict(unpack_state(saved["strategy"]))
                lines = [dict(line) for line in saved["lines"]]
                resumed_after = [*(int(n) for n in saved["resumed_after"]), len(lines)]
                cpu0 -= float(saved["cpu_seconds"])
                written = len(lines)
            except (KeyError, TypeError, ValueError, RuntimeError, struct.error) as exc:  # its content, not ours
                raise ConfigError(f"the pre-training's progress file {progress} cannot be read (its agent or "
                                  f"episodes: {type(exc).__name__}: {exc}): delete it to start over") from exc
            start = dataclasses.replace(start, resumed_after=len(lines), progress=str(progress))
        if on_start is not None:
            on_start(start)
        for ep in range(len(lines) + 1, episodes + 1):
            t0 = time.monotonic()
            seed = cfg.run.seed + ep
            model = device_model(ds, seed, cfg.model.name, cfg.model.feature_dim)
            strategy.reset_episode()
            strategy.bind_model(model)
            rng = np.random.default_rng(seed)
            ret, active, ratio = 0.0, [], []
            for r in range(1, rounds + 1):
                plan = strategy.configure_round(r, ids, rng)
                current = list(shared_arrays(model, "all"))
                results = []
                for cid in plan.selected:
                    i = ids.index(cid)
                    local = device_model(ds, seed, cfg.model.name, cfg.model.feature_dim)
                    params = {**dict(plan.config), **dict(plan.instructions.get(cid, {}))}
                    cfg_r = TrainConfig.from_mapping(base, params)
                    res = client.local_round(local, tuple(current), shards[i][0], shards[i][1], cfg_r, round=r,
                                             client_id=cid, client_index=i, device=cpu, params=params)
                    if res.num_samples == 0:
                        continue
                    cr = ClientResult(cid, res.tensors, res.num_samples, res.train_loss, dict(res.metrics))
                    reason = strategy.validate(cr)
                    if reason:
                        raise RuntimeError(f"episode {ep} round {r}: {cid}: {reason}")
                    results.append(cr)
                new = apply_update(strategy, r, strategy.aggregate(r, current, results))
                if new is not None:
                    load_arrays(model, new)
                m = strategy.evaluate(r, model)
                ret += float(m["feddo_reward"])
                active.append(len(plan.selected))
                ratio.append(float(np.mean([plan.instructions[c]["data_ratio"] for c in plan.selected]))
                             if plan.selected else 0.0)
            strategy.end_episode(rounds)
            assert strategy.agent is not None
            learned: dict[str, float] = {k: float(strategy.last_update[k]) for k in ("q_mean", "entropy")
                                         if k in strategy.last_update}
            line = {"episode": ep, "final_accuracy": strategy.phi, "return": ret, "mean_active": float(np.mean(active)),
                    "mean_ratio": float(np.mean(ratio)), "replay": len(strategy.agent.buffer),
                    "alpha": strategy.agent.alpha, "updates": strategy.agent.updates, "seconds": time.monotonic() - t0,
                    **learned}
            lines.append(line)
            r = 0  # between episodes
            try:
                write_progress(progress, settings, lines, time.process_time() - cpu0, resumed_after, strategy)
                written = len(lines)
            except OSError as exc:  # a full disk: the pre-training goes on, without this safety net
                kept = written  # a failed write leaves the file as it was
                log.warning("FedDO pre-training: the progress after episode %d could not be written to %s (%s): "
                            "the pre-training goes on; a stop now %s", ep, progress, exc,
                            f"goes on after episode {kept}, the last progress written" if kept else "starts over")
            if on_episode:
                on_episode(line)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: what the agent learned is kept
        said = _save_interrupted(strategy, cfg, out, lines, episodes, rounds, r, cpu0, start)
        # a stop during a progress write (one episode more than written) leaves the one before or the
        # new one, whichever the rename had reached: only then is the file read
        kept = written if written == len(lines) else read_progress_episodes(progress)
        if kept:
            said += (f"; the same command goes on after episode {kept} (the progress file {progress}; delete it "
                     "to start over)")
        (on_interrupt or log.warning)(said)
        raise
    agent = strategy.agent
    assert agent is not None
    cpu_s = time.process_time() - cpu0
    out = Path(out)
    if agent.updates == 0:  # check_learns makes this unreachable from a configuration; said, never written
        raise RunError(f"the agent made no DSAC-T update in {episodes * rounds} rounds (warm-up "
                       f"{agent.config.warmup} transitions, {len(agent.buffer)} stored): no policy written to {out}")
    resumes = {"resumed_after": resumed_after} if resumed_after else {}
    try:  # a stop signal meanwhile waits for the whole file (then ends the process with the policy written)
        atomic(_write_policy)(strategy, cfg, out, episodes, rounds, cpu_s, **started_from(start), **resumes)
    except (OSError, ValueError) as exc:  # a full disk, a diverged agent: said so; the progress file stays
        raise RunError(f"pre-training finished ({plural(episodes, 'episode')} x {plural(rounds, 'round')}, "
                       f"{cpu_s:.0f} CPU s) but {exc}"
                       + (f"; its first {plural(kept, 'episode')} are kept in {progress}: the same command goes on "
                          "from there" if (kept := written) else "")) from exc
    progress.unlink(missing_ok=True)
    return PretrainResult(out, lines, cpu_s, agent.parameter_counts(), tuple(resumed_after))


def _write_policy(strategy: FedDO, cfg: Config, out: Path, episodes: int, rounds: int, cpu_s: float,
                  **extra: object) -> None:
    """Write ``strategy``'s agent to ``out`` with the pre-training's metadata (``extra`` added)."""
    agent = strategy.agent
    assert agent is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    agent.save_policy(out, {"num_devices": strategy.num_devices, "global_features": GLOBAL_FEATURES,
                            "episodes": episodes, "rounds": rounds, **data_settings(cfg), "seed": cfg.run.seed,
                            "cpu_seconds": cpu_s, "reward": strategy.reward, "updates": agent.updates, **extra})


def started_from(start: StartingPoint) -> dict[str, object]:
    """The metadata keys that record a loaded starting policy (none for an untrained agent): its
    resolved path, SHA-256 and DSAC-T updates (the written ``updates`` counts from there on)."""
    if not start.loaded:
        return {}
    return {"started_from": str(Path(start.policy).resolve()), "started_from_sha256": start.sha256,
            "started_from_updates": start.updates}


def stopped_policy_path(out: Path) -> Path:
    """Where a stopped pre-training writes its policy when a file is already at ``out`` (one it
    must not replace: :func:`_save_interrupted`): ``NAME.stopped.SUFFIX`` beside it."""
    return out.with_name(f"{out.stem}.stopped{out.suffix}")


def _save_interrupted(strategy: FedDO | None, cfg: Config, out: str | Path, lines: list[dict], episodes: int,
                      rounds: int, round_reached: int, cpu0: float, start: StartingPoint | None = None) -> str:
    """A pre-training stopped by Ctrl-C or SIGTERM keeps what it learned: once the agent has
    updated, its networks are written as a policy whose metadata says ``episodes`` (the whole
    ones), ``episodes_planned``, ``interrupted_episode`` and ``interrupted_round`` (where it
    stopped, round 0: between episodes; that episode's transitions up to there were learned from
    too; a deployed run that loads it says so in a warning). It goes to ``out``, or, when a file is
    already there (an earlier pre-training's, which a stopped one must not replace), to
    :func:`stopped_policy_path` beside it. The write holds further stop signals but a second one
    (which exits at once, its temporary file removed). Returns the line that says what was kept (the
    caller re-raises the stop). Nothing is written when the agent never updated, and a failed
    write is said in that line, not raised (the stop goes on)."""
    agent = strategy.agent if strategy is not None else None
    done = len(lines)
    cpu_s = time.process_time() - cpu0
    where = f"in episode {done + 1} round {round_reached}" if round_reached else f"before episode {done + 1}"
    if strategy is None or agent is None or agent.updates == 0:
        return (f"fedfleet feddo pretrain: stopped {where}, before the agent's first DSAC-T update: no policy "
                f"written ({out} untouched)")
    out = Path(out)
    # a file there before is kept, but the policy an earlier stop of this very pre-training wrote
    # there (a resumed one: its metadata says where it stopped) is this one's, and replaced
    own = bool(start and start.resumed_after) and "interrupted_episode" in _policy_metadata(out)
    target = stopped_policy_path(out) if out.exists() and not own else out
    kept = f" (the file at {out}, there before, is untouched)" if target != out else ""
    try:
        atomic(_write_policy)(strategy, cfg, target, done, rounds, cpu_s, episodes_planned=episodes,
                              interrupted_episode=done + 1, interrupted_round=round_reached,
                              **started_from(start or StartingPoint()))
    except (OSError, ValueError) as exc:
        return f"fedfleet feddo pretrain: stopped {where}; the policy could not be written: {exc}"
    return (f"fedfleet feddo pretrain: stopped {where}; the policy learned so far ({done} of {episodes} episodes "
            f"whole, {plural(agent.updates, 'DSAC-T update')}, {cpu_s:.0f} CPU s) was written to {target}{kept}; its "
            "metadata records where it stopped")


def feddo_defaults() -> dict:
    """FedDO's constructor defaults by keyword (what an ``[algorithm]`` key left out means)."""
    return {k: v.default for k, v in inspect.signature(FedDO).parameters.items()}


def check_learns(cfg: Config, episodes: int, rounds: int) -> None:
    """Refuse a pre-training whose agent would make no DSAC-T update, so its policy would be the
    untrained one: ``[algorithm] learn = false``, ``updates_per_round = 0``, or fewer rounds in
    all (``episodes × rounds``, one transition each) than the ``warmup`` transitions the replay
    buffer needs before the first update.

    Raises:
        ConfigError: naming the key and what to change.
    """
    defaults = feddo_defaults()
    a = cfg.algorithm
    if not a.get("learn", defaults["learn"]):
        raise ConfigError(f"{cfg.source}: [algorithm] learn = false: a pre-training would never update the agent "
                          "(remove the key for fedfleet feddo pretrain; set it in the run that deploys the policy)")
    if int(a.get("updates_per_round", defaults["updates_per_round"])) == 0:
        raise ConfigError(f"{cfg.source}: [algorithm] updates_per_round = 0: a pre-training would never update the "
                          "agent")
    warmup = int(a.get("warmup", defaults["warmup"]))
    if episodes * rounds < warmup:
        raise ConfigError(f"--episodes {episodes} x --rounds {rounds} = {episodes * rounds} transitions, fewer than "
                          f"the {warmup} the replay buffer holds before the agent's first update ([algorithm] "
                          f"warmup): the policy would be the untrained one; pre-train for at least {warmup} rounds "
                          "in all, or lower warmup")


def check_policy_out(out: Path) -> None:
    """Refuse a policy path that the end of a pre-training could not write, before it trains
    (the episodes would be lost): a folder, or a path under a file or under a folder this
    process may not write in. A missing parent folder is fine (it is made at the end).

    Raises:
        ConfigError: naming ``out`` and what is wrong with it.
    """
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give the policy file's path (e.g. {out / 'feddo_policy.pt'})")
    here = out.absolute().parent
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise ConfigError(f"--out {out}: {here} is a file, not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: the folder {here} is not writable")


def run_pretrain(args, stream: TextIO | None = None) -> int:
    """``fedfleet feddo pretrain`` (see :func:`pretrain`); prints one line per episode unless ``--quiet``
    (to ``stream``; ``None``: ``sys.stdout`` as it is when called)."""
    stream = stream if stream is not None else sys.stdout
    from . import config as config_mod

    if not args.config:
        raise ConfigError("--config FILE is required")
    over: dict = {}
    if args.seed is not None:
        over[("run", "seed")] = args.seed
    if args.data_dir:
        over[("data", "data_dir")] = args.data_dir
    cfg = config_mod.load(args.config, over)
    if args.out is not None and not args.out.strip():
        raise ConfigError("--out is empty: give the policy file's path (default feddo_policy.pt)")
    out = Path(args.out or "feddo_policy.pt")

    def banner(start: StartingPoint) -> None:
        print(banner_text(cfg, args.episodes, args.rounds, out, start), file=stream, flush=True)
        note = replay_batch_note(cfg, args.episodes, args.rounds)
        if note:
            print(note, file=stream, flush=True)
    k = int(cfg.algorithm.get("num_devices") or 0) or cfg.data.clients
    legend = PROGRESS_LEGEND.format(top=k * math.log(2), target=-k,
                                    warmup=cfg.algorithm.get("warmup", feddo_defaults()["warmup"]))

    shown = [False]

    def show(m: dict) -> None:
        if not shown[0]:  # the legend above the first line, a resume's too (none when it fails before it)
            shown[0] = True
            print(legend, file=stream)
        print(progress_line(m, args.episodes), file=stream, flush=True)

    res = pretrain(cfg, episodes=args.episodes, rounds=args.rounds, out=out, on_episode=None if args.quiet else show,
                   on_start=banner, on_interrupt=lambda line: print(line, file=stream, flush=True),
                   from_scratch=bool(getattr(args, "from_scratch", False)))
    print(f"policy written to {res.policy} ({res.parameter_counts['agent']:,} agent parameters, "
          f"{res.cpu_seconds:.1f} CPU s); use it with [algorithm] policy = \"{res.policy}\"", file=stream)
    return 0


def add_pretrain_arguments(sp) -> None:
    """The options of ``fedfleet feddo pretrain``."""
    sp.add_argument("--config", help="TOML run configuration with [train] algorithm = \"feddo\"")
    sp.add_argument("--episodes", type=int, default=200, help="pre-training episodes (default 200, the paper's)")
    sp.add_argument("--rounds", type=int, default=50, help="rounds per episode (default 50)")
    sp.add_argument("--out", help="policy file to write (default feddo_policy.pt)")
    sp.add_argument("--from-scratch", action="store_true",
                    help="start from an untrained agent, ignoring the config's [algorithm] policy (by default the "
                         "pre-training goes on from that policy; the first line says which)")
    sp.add_argument("--seed", type=int, help="override [run] seed")
    sp.add_argument("--data-dir", help="folder holding the data sets (overrides [data] data_dir)")
    sp.add_argument("-q", "--quiet", action="store_true", help="no per-episode progress lines")
