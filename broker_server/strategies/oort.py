"""Oort, server half: guided participant selection over FedAvg (Lai et al., "Oort: Efficient
Federated Learning via Guided Participant Selection", OSDI 2021; SPECS §6.11; constants from the
reference code SymbioticLab/Oort ``oort.py``/``argParser.py``).

Each device i is an arm with a statistical utility U_i (Eq. (1), measured by the client half,
:func:`edge_agent.algorithms.oort.statistical_utility`; before it is explored: its sample count,
as the reference code registers clients), a duration dur_i, the round t_i it last took part and a
count. In round t (the paper's Eq. (2) and Algorithm 1, as the code computes them):

* preferred duration T = the ``round_threshold``-th percentile of all durations (sorted list,
  index ⌊n·thr/100⌋), ∞ when thr ≥ 100;
* explored arms score (:func:`oort_scores`)
  s_i = (min(U_i, clip) − 0.999·U_min)/max(U_max − 0.999·U_min, 1e-4) + sqrt(0.1·ln t / t_i),
  clip = the ``clip_bound`` quantile of the positive utilities (sorted, index ⌊n·q⌋), times
  (T/dur_i)^``round_penalty`` when dur_i > T (the system term of Eq. (2));
* ε ← max(ε·``exploration_decay``, ``exploration_min``); exploit ⌊N(1 − ε)⌋ arms sampled
  ∝ s among those with s ≥ ``cut_off_util``·s_(exploit+1) (the (exploit+1)-th best score);
* explore the rest among unexplored arms: the top ⌈``sample_window``·n⌉ by prior utility (times
  the same duration penalty), sampled ∝ it; fill up at random;
* the pacer: every ``pacer_step`` rounds, when the exploited utility of the last window changed
  by ≤ 10 % of the window before, thr += ``pacer_delta`` (relax the deadline); by ≥ 5×,
  thr −= ``pacer_delta``.

**System speed** (``duration``): ``"profile"`` (default) — dur_i = |D_i|·``seconds_per_sample``
/ the ``relative_compute_speed`` of the firmware profile the device announced
(:meth:`Strategy.on_join`), for simulated fleets, where every device trains on the same host;
``"measured"`` — the device's reported ``train_seconds`` of its last round (real fleets), with
the profile estimate until it has one. SPECS §6.11: without system heterogeneity the factor drops
out (all durations equal T).

Aggregation: FedAvg (Σ n_k w_k / Σ n_k).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..aggregate import weighted_average
from ._base import ClientResult, GlobalUpdate, RoundPlan, Scalar, Strategy
from ._registry import register_strategy

log = logging.getLogger(__name__)

DURATIONS = ("profile", "measured")


def _norm(values: list[float], clip_bound: float, thres: float) -> tuple[float, float, float]:
    """(min·0.999, range, clip value) of ``values`` as the reference code's ``get_norm``."""
    v = sorted(values)
    clip = v[min(int(len(v) * clip_bound), len(v) - 1)]
    lo = v[0] * 0.999
    return lo, max(v[-1] - lo, thres), clip


def preferred_duration(durations: Sequence[float], round_threshold: float) -> float:
    """T: the sorted durations' entry at ⌊n·thr/100⌋ (capped at the last); ∞ for thr ≥ 100."""
    if round_threshold >= 100 or not durations:
        return math.inf
    d = sorted(durations)
    return d[min(int(len(d) * round_threshold / 100.0), len(d) - 1)]


def oort_scores(arms: Mapping[str, Mapping[str, float]], feasible: Sequence[str], t: int, prefer: float,
                clip_bound: float = 0.98, round_penalty: float = 2.0) -> dict[str, float]:
    """The exploitation scores s_i of the explored feasible arms (module docstring).

    Args:
        arms: id → {"reward": U_i, "duration": dur_i, "time_stamp": t_i, "count": n_i}.
        feasible: the ids that may be picked.
        t: the current round (≥ 1).
        prefer: T, the preferred duration.
    """
    explored = [c for c in feasible if arms[c]["count"] > 0]
    positive = [arms[c]["reward"] for c in explored if arms[c]["reward"] > 0]
    if not explored:
        return {}
    lo, rng, clip = _norm(positive or [0.0], clip_bound, 1e-4)
    out = {}
    for c in explored:
        a = arms[c]
        sc = (min(a["reward"], clip) - lo) / rng + math.sqrt(0.1 * math.log(max(t, 1)) / max(a["time_stamp"], 1))
        if a["duration"] > prefer:
            sc *= (prefer / max(1e-4, a["duration"])) ** round_penalty
        out[c] = sc
    return out


@register_strategy("oort")
class Oort(Strategy):
    """Oort selection over FedAvg; every ``[algorithm]`` key is a constant of the module docstring
    (defaults: the reference code's; ``cut_off_util`` 0.7 and ``clip_bound`` 0.98 as SPECS §6.11
    reads its argParser)."""

    name = "oort"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, Scalar] | None = None, exploration: float = 0.9,
                 exploration_decay: float = 0.95, exploration_min: float = 0.2, cut_off_util: float = 0.7,
                 clip_bound: float = 0.98, round_threshold: float = 10.0, round_penalty: float = 2.0,
                 pacer_step: int = 20, pacer_delta: float = 5.0, sample_window: float = 5.0,
                 duration: str = "profile", seconds_per_sample: float = 1e-3) -> None:
        if not 0 < participation_rate <= 1:
            raise ValueError(f"participation_rate must be in (0, 1], got {participation_rate}")
        if duration not in DURATIONS:
            raise ValueError(f"duration = {duration!r} must be one of {DURATIONS}")
        if not (0 <= exploration_min <= exploration <= 1 and 0 < exploration_decay <= 1):
            raise ValueError(f"need 0 <= exploration_min ({exploration_min}) <= exploration ({exploration}) <= 1 "
                             f"and exploration_decay ({exploration_decay}) in (0, 1]")
        if pacer_step < 1 or sample_window <= 0 or seconds_per_sample <= 0:
            raise ValueError("pacer_step must be >= 1, sample_window and seconds_per_sample > 0")
        # a negative quantile or percentile would index the sorted lists from their end
        for key, value, hi in (("cut_off_util", cut_off_util, math.inf), ("clip_bound", clip_bound, 1.0),
                               ("round_threshold", round_threshold, 100.0), ("round_penalty", round_penalty, math.inf),
                               ("pacer_delta", pacer_delta, 100.0)):
            if not 0 <= value <= hi:
                raise ValueError(f"{key} = {value!r} must be in [0, {hi:g}]")
        self.participation_rate, self.min_clients = participation_rate, min_clients
        self.train_config = dict(train_config or {})
        self.exploration, self.decay, self.exploration_min = float(exploration), exploration_decay, exploration_min
        self.cut_off_util, self.clip_bound, self.round_threshold = cut_off_util, clip_bound, float(round_threshold)
        self.round_penalty, self.pacer_step, self.pacer_delta = round_penalty, pacer_step, pacer_delta
        self.sample_window, self.duration, self.seconds_per_sample = sample_window, duration, seconds_per_sample
        self.arms: dict[str, dict[str, float]] = {}
        self.explore_history: list[float] = []
        self.exploit_history: list[float] = []
        self.last_exploit: list[str] = []
        self.last_explore: list[str] = []
        self.last_scores: dict[str, float] = {}
        self.successful: list[str] = []

    def on_join(self, client_id: str, profile: str, num_samples: int) -> None:
        """Register the arm (first join only): prior utility |D_i|, duration from the profile."""
        from edge_agent.profiles import ProfileError, get_profile

        try:
            speed = get_profile(profile).relative_compute_speed
        except ProfileError:
            log.warning("Oort: profile %r of %s unknown: relative speed 1.0", profile, client_id)
            speed = 1.0
        est = max(1, num_samples) * self.seconds_per_sample / speed
        arm = self.arms.get(client_id)
        if arm is None:
            self.arms[client_id] = {"reward": float(num_samples), "duration": est, "time_stamp": 0.0, "count": 0.0,
                                    "profile_duration": est}
        else:
            arm["profile_duration"] = est

    def _pacer(self, t: int) -> None:
        def mean_util(ids: list[str]) -> float:
            got = [self.arms[c]["reward"] for c in ids if c in self.successful]
            return sum(got) / (len(got) + 1e-4)

        self.explore_history.append(mean_util(self.last_explore))
        self.exploit_history.append(mean_util(self.last_exploit))
        self.successful = []
        k = self.pacer_step
        if t >= 2 * k and t % k == 0:
            before, now = sum(self.exploit_history[-2 * k:-k]), sum(self.exploit_history[-k:])
            if abs(now - before) <= before * 0.1:
                self.round_threshold = min(100.0, self.round_threshold + self.pacer_delta)
            elif abs(now - before) >= before * 5:
                self.round_threshold = max(self.pacer_delta, self.round_threshold - self.pacer_delta)

    def select(self, t: int, feasible: Sequence[str], n: int, rng: np.random.Generator) -> list[str]:
        """Oort's pick of ``n`` of ``feasible`` in round ``t`` (module docstring); updates ε, the
        pacer and the round's exploit/explore lists."""
        for c in feasible:
            if c not in self.arms:  # joined without on_join (a direct caller): a neutral prior
                self.arms[c] = {"reward": 1.0, "duration": 1.0, "time_stamp": 0.0, "count": 0.0,
                                "profile_duration": 1.0}
        self._pacer(t)
        prefer = preferred_duration([a["duration"] for a in self.arms.values()], self.round_threshold)
        scores = oort_scores(self.arms, feasible, t, prefer, self.clip_bound, self.round_penalty)
        self.last_scores = scores
        self.exploration = max(self.exploration * self.decay, self.exploration_min)
        exploit_n = min(int(n * (1.0 - self.exploration)), len(scores))
        picked: list[str] = []
        if exploit_n > 0:
            ranked = sorted(scores, key=lambda c: (-scores[c], c))
            cut = scores[ranked[min(exploit_n, len(ranked) - 1)]] * self.cut_off_util
            pool = [c for c in ranked if scores[c] >= cut] or ranked[:exploit_n]
            p = np.array([scores[c] for c in pool]) / max(1e-4, sum(scores[c] for c in pool))
            picked = list(rng.choice(pool, min(exploit_n, len(pool)), replace=False, p=p / p.sum()))
        self.last_exploit = list(picked)
        unexplored = [c for c in feasible if self.arms[c]["count"] == 0]
        explore: list[str] = []
        if unexplored:
            init = {}
            for c in unexplored:
                a = self.arms[c]
                init[c] = a["reward"] * ((prefer / max(1e-4, a["duration"])) ** self.round_penalty
                                         if a["duration"] > prefer else 1.0)
            explore_n = min(len(unexplored), n - len(picked))
            if explore_n > 0:
                top = sorted(init, key=lambda c: (-init[c], c))[:min(math.ceil(self.sample_window * explore_n),
                                                                       len(init))]
                w = np.array([init[c] for c in top], np.float64)
                w = w / w.sum() if w.sum() > 0 else np.full(len(top), 1 / len(top))
                explore = list(rng.choice(top, explore_n, replace=False, p=w))
        else:
            self.exploration_min = self.exploration = 0.0
        self.last_explore = list(explore)
        picked += explore
        rest = [c for c in feasible if c not in picked]
        if len(picked) < n and rest:
            picked += list(rng.choice(rest, min(n - len(picked), len(rest)), replace=False))
        return [str(c) for c in picked]

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """N = max(min_clients, round(participation_rate·K)) of the available devices, by :meth:`select`."""
        n = min(len(available), max(self.min_clients, int(np.round(self.participation_rate * len(available)))))
        return RoundPlan(selected=tuple(sorted(self.select(round, sorted(available), n, rng))),
                         config=dict(self.train_config))

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """FedAvg, and each reporting arm's new utility, duration, round and count."""
        if not results:
            return None
        arms = {c: dict(a) for c, a in self.arms.items()}
        for r in results:
            a = arms.setdefault(r.client_id, {"reward": 0.0, "duration": 1.0, "time_stamp": 0.0, "count": 0.0,
                                              "profile_duration": 1.0})
            u = r.metrics.get("oort_utility")
            a["reward"] = float(u) if isinstance(u, (int, float)) and not isinstance(u, bool) else 0.0
            secs = r.metrics.get("train_seconds")
            if self.duration == "measured" and isinstance(secs, (int, float)) and not isinstance(secs, bool):
                a["duration"] = float(secs)
            else:
                a["duration"] = a["profile_duration"]
            a["time_stamp"], a["count"] = float(round), a["count"] + 1  # round: the hook's argument
        return GlobalUpdate(tensors=weighted_average([r.tensors for r in results], [r.num_samples for r in results]),
                            state={"arms": arms, "successful": [r.client_id for r in results]},
                            metrics={"oort_scores": dict(self.last_scores), "oort_exploit": list(self.last_exploit),
                                     "oort_explore": list(self.last_explore)})

    def round_metrics(self) -> dict:
        """ε and the pacer's percentile."""
        return {"oort_exploration": self.exploration, "oort_round_threshold": self.round_threshold}

    def state_dict(self) -> dict:
        """Arms, ε, the pacer and its histories."""
        return {"arms": self.arms, "exploration": self.exploration, "exploration_min": self.exploration_min,
                "round_threshold": self.round_threshold, "explore_history": self.explore_history,
                "exploit_history": self.exploit_history, "last_exploit": self.last_exploit,
                "last_explore": self.last_explore, "successful": self.successful}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        if not state:
            return
        self.arms = {c: {k: float(v) for k, v in a.items()} for c, a in state["arms"].items()}
        for k in ("exploration", "exploration_min", "round_threshold"):
            setattr(self, k, float(state[k]))
        for k in ("explore_history", "exploit_history"):
            setattr(self, k, [float(v) for v in state[k]])
        for k in ("last_exploit", "last_explore", "successful"):
            setattr(self, k, [str(v) for v in state[k]])

