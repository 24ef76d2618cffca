"""Surviving a lost rank: pure helpers for automatic restarts (no torch, no Megatron).

With ``torchrun --max-restarts N ... --save DIR --load DIR`` a job that loses a rank is restarted
whole by torchrun; every worker then loads the newest complete checkpoint in DIR (or starts from
scratch while DIR holds none). What is here: which restart this is, what a checkpoint must agree
on with the run that loads it, the metrics file after a resume (each iteration recorded once),
and when a time-based save (``--save-interval-minutes``) is due.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

# flags a checkpoint must share with the run that loads it: (attribute, flag as the user types it)
RUN_FLAGS: Tuple[Tuple[str, str], ...] = (
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("layers_per_stage", "transformer layers per stage (--decoder-first-pipeline-num-layers, "
     "--decoder-last-pipeline-num-layers, --account-for-embedding-in-pipeline-split, "
     "--account-for-loss-in-pipeline-split, --pipeline-model-parallel-layout)"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("data_parallel_size", "data-parallel size (ranks / (TP x PP))"),
    ("use_distributed_optimizer", "--use-distributed-optimizer"),
    ("dist_ckpt_optim_fully_reshardable", "--dist-ckpt-optim-fully-reshardable"),
    ("virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage (chunks)"),
    ("pipeline_schedule", "--pipeline-schedule"),
    ("paci_accumulation_factor", "--paci-accumulation-factor"),
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("seq_length", "--seq-length"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("vocab_size", "--vocab-size"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("normalization", "--normalization"),
)


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times torchrun has restarted this job's workers (0: the first launch)."""
    text = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def run_fingerprint(flags: Mapping[str, Any], cfg) -> Dict:
    """What a checkpoint records about the run that wrote it (see RUN_FLAGS): its flag values
    by name (``flags``, as the entry point parsed them), the accumulation factor as resolved
    (``cfg``: a ``config.PaciConfig``)."""
    found = {attr: flags.get(attr) for attr, _ in RUN_FLAGS}
    found["paci_accumulation_factor"] = cfg.accumulation
    return found


# what a run may change on --load: a drained PACI checkpoint holds what a 1F1B one holds, and
# Megatron-Core's sharded checkpoints reshard the model and the optimizer over P, TP and DP
SWITCHABLE = {"pipeline_schedule", "paci_accumulation_factor"}
RESHARDABLE = ("pipeline_model_parallel_size", "tensor_model_parallel_size", "data_parallel_size")
SWITCHABLE_SCHEDULES = {"1f1b", "paci"}


def describe_mismatch(saved: Optional[Mapping], current: Mapping) -> List[str]:
    """One line per flag on which a checkpoint and this run differ in a way the load cannot
    take; [] when it can. A checkpoint written before fingerprints existed (``saved`` None)
    is not checked. Switching between 1f1b and paci, or changing a, is allowed
    (``describe_switch`` names it)."""
    if not saved:
        return []
    saved, current = _normalized(saved), _normalized(current)
    out = []
    for attr, flag in RUN_FLAGS:
        if attr not in saved or attr not in current or saved[attr] == current[attr]:
            continue
        if attr in SWITCHABLE and {saved["pipeline_schedule"], current["pipeline_schedule"]} \
                <= SWITCHABLE_SCHEDULES:
            continue
        if attr in ("make_vocab_size_divisible_by", "dist_ckpt_optim_fully_reshardable"):
            continue  # what matters: the padded vocabulary (below), the saved format (here)
        hint = ""
        if attr == "layers_per_stage" and saved.get("pipeline_model_parallel_size") != \
                current.get("pipeline_model_parallel_size"):
            continue  # moving layers between stages is a reshard; a new P says it already
        if attr in RESHARDABLE or attr == "layers_per_stage":
            if attr == "data_parallel_size" or not current.get("use_distributed_optimizer") \
                    or saved.get("dist_ckpt_optim_fully_reshardable"):
                continue
            keep = "layers per stage" if attr == "layers_per_stage" else "P and TP"
            hint = (" (this distributed-optimizer checkpoint reshards over data parallelism "
                    f"only: keep its {keep}, or write it with "
                    "--dist-ckpt-optim-fully-reshardable)")
        out.append(f"{flag}: checkpoint {saved[attr]}, this run {current[attr]}{hint}")
    return out + _vocab_mismatch(saved, current)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """The embedding's rows: the vocabulary rounded up to a multiple of ``divisible_by`` x TP,
    as Megatron-LM pads it (VocabParallelEmbedding needs the TP multiple)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _vocab_rows(run: Mapping) -> Optional[int]:
    if not run.get("vocab_size"):
        return None
    return padded_vocab_size(run["vocab_size"], run.get("tensor_model_parallel_size") or 1,
                             run.get("make_vocab_size_divisible_by") or 1)


def _vocab_mismatch(saved: Mapping, current: Mapping) -> List[str]:
    """A TP change (or another --make-vocab-size-divisible-by) may pad the embedding to other
    rows than the checkpoint holds: refused, naming a divisor that keeps them."""
    before, after = _vocab_rows(saved), _vocab_rows(current)
    if before is None or after is None or before == after or \
            saved.get("vocab_size") != current.get("vocab_size"):
        return []
    tp = current.get("tensor_model_parallel_size") or 1
    fits = [d for d in (2 ** k for k in range(before.bit_length()))
            if padded_vocab_size(current["vocab_size"], tp, d) == before]
    fix = (f"--make-vocab-size-divisible-by {fits[-1]} keeps {before} rows at TP={tp}" if fits
           else f"no --make-vocab-size-divisible-by gives {before} rows at TP={tp}: a checkpoint "
                "meant for another TP is written with a divisor that covers it, e.g. 128")
    return [f"--make-vocab-size-divisible-by: the checkpoint's embedding has {before} rows, "
            f"this run pads the vocabulary to {after} ({fix})"]


def layout_of(run: Mapping) -> Tuple:
    """(P, TP, DP) of a fingerprint; None where a checkpoint did not record it."""
    return tuple(run.get(attr) for attr in RESHARDABLE)


def layout_changed(saved: Tuple, current: Tuple) -> bool:
    """Whether a load goes into another (P, TP, DP); what the checkpoint did not record
    counts as unchanged."""
    return any(s is not None and s != now for s, now in zip(saved, current))


def describe_reshard(saved: Optional[Mapping], current: Mapping) -> Optional[str]:
    """The one line a load into another parallel layout prints; None for the same layout."""
    if not saved:
        return None
    before, after = layout_of(saved), layout_of(current)
    if not layout_changed(before, after):
        return None
    show = lambda layout: " ".join(f"{n}={v if v is not None else '?'}"  # noqa: E731
                                   for n, v in zip(("P", "TP", "DP"), layout))
    return (f"resharding the checkpoint from {show(before)} to {show(after)} (Megatron-Core's "
            "sharded checkpoint: model and optimizer state; the per-rank RNG states and fp16 "
            "loss scalers of the old layout are not taken)")


def _normalized(run: Mapping) -> Dict:
    """A run's fingerprint with defaults spelled out (no --ffn-hidden-size: 4 x hidden)."""
    run = dict(run)
    if run.get("ffn_hidden_size") is None and run.get("hidden_size"):
        run["ffn_hidden_size"] = 4 * run["hidden_size"]
    return run


def describe_switch(saved: Optional[Mapping], current: Mapping) -> Optional[str]:
    """The one line a load that changes the schedule (or PACI's a) prints; None otherwise."""
    def named(run):
        a = f" (a={run['paci_accumulation_factor']})" if run["pipeline_schedule"] == "paci" \
            else ""
        return f"--pipeline-schedule {run['pipeline_schedule']}{a}"

    if not saved or "pipeline_schedule" not in saved or named(saved) == named(current):
        return None
    return (f"the checkpoint was written with {named(saved)}, this run continues with "
            f"{named(current)} (a drained checkpoint holds what either needs)")


def trim_metrics(path: str, iteration: int) -> Tuple[int, int]:
    """Keep only the records of iterations <= ``iteration`` in the metrics file at ``path``
    (the resumed run writes the later ones again, so each iteration is recorded once).

    Rewritten through a temporary file and ``os.replace``, so a kill leaves the old or the new
    file, never half of one. A line cut short by a kill is dropped. Returns (kept, dropped)."""
    if not os.path.exists(path):
        return 0, 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if int(record.get("iteration", 0)) <= iteration:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return len(kept), dropped


class SaveClock:
    """When a time-based save is due, without a collective at every iteration.

    Every rank holds the same clock and calls :meth:`is_check_point` at each iteration; it is
    True at the same iterations on every rank because they only change through
    :meth:`agree`, which every rank calls with the same values (those of global rank 0, passed
    along by one small broadcast). At a check point rank 0 proposes with :meth:`propose`: save
    now when ``interval_s`` has passed since the last save, and check again after about
    ``interval_s / CHECKS_PER_INTERVAL`` of measured iteration time (at least one iteration).
    So the work lost to a crash stays below ``interval_s * (1 + 1/CHECKS_PER_INTERVAL)`` plus
    one iteration, whatever the iteration time, at about CHECKS_PER_INTERVAL broadcasts per
    interval."""

    CHECKS_PER_INTERVAL = 10

    def __init__(self, interval_s: float, iteration: int, now: float):
        if not interval_s > 0:
            raise ValueError(f"save interval must be > 0 s, got {interval_s}")
        self.interval_s = interval_s
        self.last_save = now
        self.last_check = (iteration, now)
        self.next_check = iteration + 1  # the first check measures one iteration

    def is_check_point(self, iteration: int) -> bool:
        return iteration >= self.next_check

    def propose(self, iteration: int, now: float) -> Tuple[bool, int]:
        """(save now?, iteration of the next check), from this rank's clock."""
        done = max(1, iteration - self.last_check[0])
        per_iteration = max(now - self.last_check[1], 1e-9) / done
        step = int(self.interval_s / self.CHECKS_PER_INTERVAL / per_iteration)
        return now - self.last_save >= self.interval_s, iteration + max(1, step)

    def agree(self, iteration: int, next_check: int, now: float) -> None:
        if next_check <= iteration:
            raise ValueError(f"next check {next_check} is not after iteration {iteration}")
        self.last_check = (iteration, now)
        self.next_check = next_check

    def saved(self, now: float) -> None:
        """Any save (by time, by --save-interval) restarts the interval."""
        self.last_save = now


def exit_with_parent(parent_pid: int) -> None:
    """Run first in a helper process: make it die when ``parent_pid`` (its parent) dies, even
    by SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op). Without it a helper of a killed
    worker outlives the restart, holding memory and the launcher's output pipes."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(0)
