"""Multi-process checks of the PACI runtime on a real GPTModel (run under torchrun).

    torchrun --standalone --nproc-per-node N tests/workers/paci_cases.py --out DIR CASE [CASE ...]

Each case writes DIR/CASE.rank<R>.json; the pytest side asserts on them. Several cases share
one launch (importing Megatron costs seconds), re-initialising the parallel layout per case.
"""

import hashlib
import json
import os
import sys
from typing import Dict, List

import torch

from paci_megatron.mcore import build
from paci_megatron.mcore.runtime import PaciRuntime, get_forward_backward_func
from paci_megatron.schedule import drift_bound

from case_args import parse_case_args  # same folder: the script's own

MBS = 2


def setup(tp=1, pp=1, seed=1234, layers=None, lr=2e-3, clip_grad=1.0):
    layers = layers or max(4, pp)
    info = build.init_distributed(tp=tp, pp=pp, seed=seed, timeout_s=90)
    spec = build.GPTSpec(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=128, untie_embeddings=True)
    model = build.build_gpt_model(spec, seed=seed)
    opt = build.build_optimizer(model, lr=lr, clip_grad=clip_grad)
    sched = build.build_lr_scheduler(opt, lr=lr, min_lr=lr / 10, warmup_steps=0,
                                     decay_steps=10_000, decay_style="cosine")
    reads = info["is_first"] or info["is_last"]
    data = build.mock_data_iterator(spec, MBS, seed) if reads else None
    return dict(info=info, spec=spec, model=model, opt=opt, sched=sched, data=data)


def digest(model) -> str:
    h = hashlib.sha256()
    for chunk in model:
        for name, p in sorted(chunk.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def losses_hex(store: List[dict]) -> List[str]:
    return [float(d["lm loss"]).hex() for d in store]


def call(fb, ctx, n, forward_step_func=None):
    return fb(forward_step_func=forward_step_func or build.gpt_forward_step,
              data_iterator=ctx["data"], model=ctx["model"], num_microbatches=n,
              seq_length=ctx["spec"].seq_length, micro_batch_size=MBS, forward_only=False)


def train_stock(ctx, iters: int, n: int, logged=None, after_step=None) -> List:
    """Stock Megatron: ``iters`` forward-backward calls of ``n`` micro-batches, each followed
    by the optimizer (and LR) step. ``logged`` turns a call's store into what is compared
    (default ``losses_hex``); ``after_step(ok)`` runs after each step."""
    fb = get_forward_backward_func()
    out = []
    dp = ctx["info"]["dp_size"]
    for _ in range(iters):
        for chunk in ctx["model"]:
            chunk.zero_grad_buffer()
        ctx["opt"].zero_grad()
        out += (logged or losses_hex)(call(fb, ctx, n))
        ok, _, _ = ctx["opt"].step()
        if ok:
            ctx["sched"].step(increment=n * MBS * dp)
        if after_step is not None:
            after_step(ok)
    return out


def make_runtime(ctx, kind: str, a: int, **kw) -> PaciRuntime:
    rt = PaciRuntime(kind=kind, accumulation=a, **kw)
    rt.bind(ctx["opt"], ctx["sched"], lr_increment=a * MBS * ctx["info"]["dp_size"])
    return rt


def train_runtime(ctx, rt: PaciRuntime, iters: int, n: int, forward_step_func=None,
                  logged=None, after_call=None) -> List:
    """``iters`` training calls of the runtime; ``logged`` and ``after_call()`` as in
    ``train_stock``."""
    out = []
    for _ in range(iters):
        out += (logged or losses_hex)(call(rt.forward_backward, ctx, n, forward_step_func))
        if after_call is not None:
            after_call()
    return out


def finish(case: str, out_dir: str, result: Dict) -> None:
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"{case}.rank{rank}.json"), "w") as f:
        json.dump(result, f)


# --- cases ------------------------------------------------------------------------------------

def case_flush_equals_stock(pp: int, out_dir: str) -> None:
    """The executor running the flush action list == stock 1F1B + optimizer.step(), bitwise."""
    iters, a = 10, 4
    ctx = setup(pp=pp)
    stock = train_stock(ctx, iters, a)
    stock_digest = digest(ctx["model"])
    ctx = setup(pp=pp)  # re-initialises the model-parallel state and re-seeds
    rt = make_runtime(ctx, "flush", a)
    flush = train_runtime(ctx, rt, iters, a)
    finish(f"flush_equals_stock_p{pp}", out_dir, dict(
        stage=ctx["info"]["pp_rank"], stock=stock, flush=flush, stock_digest=stock_digest,
        flush_digest=digest(ctx["model"]), steps=rt.drift.version, drift=rt.drift.max))


class SavedWeightProbe:
    """Records, for every weight autograd saves in a forward, whether backward later reads the
    same values (no step in between) or different ones (a step updated them in place)."""

    def __init__(self, model, rt: PaciRuntime):
        self.rt = rt
        self.ptrs = {p.untyped_storage().data_ptr(): n for chunk in model
                     for n, p in chunk.named_parameters()}
        self.current = None
        self.records = []  # (mb, fwd_version, bwd_version, same_values)

    def pack(self, t):
        name = self.ptrs.get(t.untyped_storage().data_ptr())
        if name is None:
            return t
        return ("weight", t, t.detach().clone(), self.current, self.rt.drift.version)

    def unpack(self, obj):
        if isinstance(obj, tuple) and obj and obj[0] == "weight":
            _, t, snapshot, mb, fwd_version = obj
            self.records.append((mb, fwd_version, self.rt.drift.version,
                                 bool(torch.equal(t, snapshot))))
            return t
        return obj

    def forward_step(self, data_iterator, model):
        self.current = self.rt.data.current
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return build.gpt_forward_step(data_iterator, model)


def case_paci_drift(pp: int, out_dir: str, accumulations=(1, 2, 4), n_per_a=None) -> None:
    """PACI async: drift per stage equals ceil((P-1-s)/a); loss goes down; backward reads the
    weights as updated after the forward (no stash)."""
    result = {}
    for a in accumulations:
        n = a if n_per_a is None else n_per_a
        iters = max(6, 24 // n)
        ctx = setup(pp=pp)
        rt = make_runtime(ctx, "paci", a)
        probe = SavedWeightProbe(ctx["model"], rt)
        losses = train_runtime(ctx, rt, iters, n, forward_step_func=probe.forward_step)
        first_vs_last = None
        if losses:
            head = [float.fromhex(x) for x in losses[:n]]
            tail = [float.fromhex(x) for x in losses[-n:]]
            first_vs_last = [sum(head) / n, sum(tail) / n]
        changed = [r for r in probe.records if r[2] > r[1]]
        unchanged = [r for r in probe.records if r[2] == r[1]]
        dropped = rt.drain()
        result[str(a)] = dict(
            stage=ctx["info"]["pp_rank"], max=rt.drift.max,
            bound=drift_bound(pp, ctx["info"]["pp_rank"], a),
            histogram={str(k): v for k, v in rt.drift.histogram.items()},
            steps=rt.drift.version, backwards=sum(rt.drift.histogram.values()),
            loss_first_last=first_vs_last,
            stepped_reads=len(changed), stepped_reads_new_values=sum(not r[3] for r in changed),
            plain_reads=len(unchanged), plain_reads_same_values=sum(r[3] for r in unchanged),
            dropped=dropped, iters=iters, n=n)
    finish(f"paci_drift_p{pp}", out_dir, result)


def case_p1_equals_accumulation(out_dir: str) -> None:
    """P=1 PACI == stock no-pipelining gradient accumulation + step, bitwise."""
    iters, a = 10, 4
    ctx = setup(pp=1)
    stock = train_stock(ctx, iters, a)
    stock_digest = digest(ctx["model"])
    ctx = setup(pp=1)
    rt = make_runtime(ctx, "paci", a)
    paci = train_runtime(ctx, rt, iters, a)
    finish("p1_equals_accumulation", out_dir, dict(
        stock=stock, paci=paci, stock_digest=stock_digest, paci_digest=digest(ctx["model"]),
        drift=rt.drift.max, steps=rt.drift.version))


def case_layout(tp: int, pp: int, out_dir: str) -> None:
    """PACI completes with tensor or data parallelism inside each stage."""
    ctx = setup(tp=tp, pp=pp)
    rt = make_runtime(ctx, "paci", 4)
    losses = train_runtime(ctx, rt, 5, 4)
    info = ctx["info"]
    finish(f"layout_tp{tp}_pp{pp}", out_dir, dict(
        info=info, losses=[float.fromhex(x) for x in losses], drift=rt.drift.max,
        bound=drift_bound(pp, info["pp_rank"], 4), steps=rt.drift.version))


def numbered(data):
    """The stream with a sequence number in every item (``seq``, ignored by the forward step)
    so that each micro-batch is named uniquely."""
    if data is None:
        return None
    return ({**item, "seq": i} for i, item in enumerate(data))


def tokens_sha256(item) -> str:
    return hashlib.sha256(item["tokens"].contiguous().numpy().tobytes()).hexdigest()


def case_drain_replays(out_dir: str) -> None:
    """Drain mid-run == flushing there: PACI, drain after 3 calls, 3 more calls, equals the data
    the flush schedule would have seen (same micro-batches, in order, none lost or doubled).
    Records, per forward, (micro-batch index, sequence number of the item it read, hash of its
    tokens)."""
    ctx = setup(pp=2)
    ctx["data"] = numbered(ctx["data"])
    seen = []

    def recording_step(data_iterator, model):
        out, loss = build.gpt_forward_step(data_iterator, model)
        item = rt.data.taken.get(rt.data.current)
        if item:
            seen.append([rt.data.current, item[-1]["seq"], tokens_sha256(item[-1])])
        return out, loss

    rt = make_runtime(ctx, "paci", 4)
    train_runtime(ctx, rt, 3, 4, forward_step_func=recording_step)
    dropped = rt.drain()
    train_runtime(ctx, rt, 3, 4, forward_step_func=recording_step)
    rt.drain()
    ctx = setup(pp=2)
    reference = []  # the hash of the i-th item of the same stream, read straight
    for _ in range(24 + 4):
        if ctx["data"] is not None:
            reference.append(tokens_sha256(next(ctx["data"])))
    finish("drain_replays", out_dir, dict(stage=ctx["info"]["pp_rank"], seen=seen,
                                          reference=reference, dropped=dropped))


def _poison(rt: PaciRuntime, stage: int, mb: int):
    """A forward step that turns micro-batch ``mb``'s output into NaN at ``stage``."""

    def forward_step(data_iterator, model):
        out, loss = build.gpt_forward_step(data_iterator, model)
        if rt.stage == stage and rt.data.current == mb:
            out = out * float("nan")
        return out, loss

    return forward_step


def case_nonfinite_skip(out_dir: str) -> None:
    """A NaN loss at the last stage: both stages see non-finite gradients at that group's step
    and skip exactly that update; training goes on with finite losses."""
    ctx = setup(pp=2)
    rt = make_runtime(ctx, "paci", 4)
    losses = train_runtime(ctx, rt, 6, 4, forward_step_func=_poison(rt, 1, 9))
    finish("nonfinite_skip", out_dir, dict(
        stage=rt.stage, skipped=rt.skipped_steps,
        ok=[s.update_successful for s in rt.steps],
        losses=[float.fromhex(x) for x in losses], digest_finite=all(
            bool(torch.isfinite(p).all()) for c in ctx["model"] for p in c.parameters())))


def case_nonfinite_abort(out_dir: str) -> None:
    ctx = setup(pp=1)
    rt = make_runtime(ctx, "paci", 4, on_nonfinite="abort")
    message = None
    try:
        train_runtime(ctx, rt, 3, 4, forward_step_func=_poison(rt, 0, 5))
    except Exception as exc:  # the executor wraps it with the stage and action
        message = str(exc)
    finish("nonfinite_abort", out_dir, dict(message=message))


def case_raise_in_forward(out_dir: str) -> None:
    """Stage 1 raises in a forward: the whole job must stop (not hang)."""
    ctx = setup(pp=4)
    rt = make_runtime(ctx, "paci", 4)

    def forward_step(data_iterator, model):
        if rt.stage == 1 and rt.data.current == 10:
            raise RuntimeError("injected failure in forward")
        return build.gpt_forward_step(data_iterator, model)

    print(f"[paci-test] rank {torch.distributed.get_rank()} = pipeline stage {rt.stage}",
          flush=True)
    train_runtime(ctx, rt, 50, 4, forward_step_func=forward_step)


CASES = {
    "flush_equals_stock_p2": lambda d: case_flush_equals_stock(2, d),
    "flush_equals_stock_p4": lambda d: case_flush_equals_stock(4, d),
    "paci_drift_p2": lambda d: case_paci_drift(2, d, accumulations=(1, 2)),
    "paci_drift_p4": lambda d: case_paci_drift(4, d),
    "paci_drift_p8": lambda d: case_paci_drift(8, d, accumulations=(1, 2, 4, 8)),
    "p1_equals_accumulation": case_p1_equals_accumulation,
    "layout_tp1_pp2": lambda d: case_layout(1, 2, d),
    "layout_tp2_pp2": lambda d: case_layout(2, 2, d),
    "drain_replays": case_drain_replays,
    "nonfinite_skip": case_nonfinite_skip,
    "nonfinite_abort": case_nonfinite_abort,
    "raise_in_forward": case_raise_in_forward,
}


def main() -> int:
    args = parse_case_args(CASES)
    # the default process group lives for the whole launch (re-creating it under torchrun
    # reuses the agent's store keys); each case re-initialises only Megatron's groups
    for case in args.cases:
        CASES[case](args.out)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
