"""fp16 (a loss scaler per stage) and per-token loss under PACI, P=2 (run under torchrun).

    torchrun --standalone --nproc-per-node 2 tests/workers/precision_cases.py --out DIR CASE ...

Each case writes DIR/CASE.rank<R>.json; tests/test_fp16_per_token.py asserts on them.
"""

import sys

import torch

from paci_megatron.mcore import build
from paci_megatron.mcore.grad_meta import GradMeta
import paci_cases  # same folder: the script's own
from paci_cases import MBS, digest, finish, make_runtime
from case_args import parse_case_args


def setup(*, fp16=False, per_token=False, pp=2, seed=1234, lr=2e-3, scale=2.0 ** 12,
          window=1000, hysteresis=1, stage0_scale=None):
    info = build.init_distributed(pp=pp, seed=seed, timeout_s=90)
    spec = build.GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=128, untie_embeddings=True, fp16=fp16,
                         calculate_per_token_loss=per_token)
    model = build.build_gpt_model(spec, seed=seed)
    if stage0_scale is not None and info["is_first"]:
        scale = stage0_scale  # scalers that differ from the start
    opt = build.build_optimizer(model, lr=lr, clip_grad=1.0, fp16=fp16, initial_loss_scale=scale,
                                loss_scale_window=window, hysteresis=hysteresis)
    sched = build.build_lr_scheduler(opt, lr=lr, min_lr=lr / 10, warmup_steps=0,
                                     decay_steps=10_000, decay_style="cosine")
    reads = info["is_first"] or info["is_last"]
    data = build.mock_data_iterator(spec, MBS, seed) if reads else None
    if data is not None and per_token:
        data = masked(data)
    return dict(info=info, spec=spec, model=model, opt=opt, sched=sched, data=data)


def masked(data):
    """Loss masks that keep a different number of tokens per row and micro-batch (1..16 of
    16), so that the groups' token counts differ."""
    for i, item in enumerate(data):
        mask = item["loss_mask"].clone()
        for row in range(mask.shape[0]):
            mask[row, kept_tokens(i, row):] = 0.0
        yield {**item, "loss_mask": mask}


def kept_tokens(i: int, row: int) -> int:
    return 1 + (i * 2654435761 + row * 40503) % 97 % 16


def losses_hex(store):
    """Every logged value as float hex (per-token: [loss sum, tokens] per micro-batch)."""
    return [[float(x).hex() for x in torch.as_tensor(d["lm loss"]).view(-1)] for d in store]


def scale_of(ctx) -> float:
    return float(ctx["opt"].get_loss_scale())


def train_stock(ctx, iters, n):
    """Stock Megatron with this stage's loss scale and step success after every step."""
    scales, ok_list = [], []

    def record(ok):
        scales.append(scale_of(ctx))
        ok_list.append(bool(ok))

    out = paci_cases.train_stock(ctx, iters, n, logged=losses_hex, after_step=record)
    return out, scales, ok_list


def train_runtime(ctx, rt, iters, n, forward_step_func=None):
    scales = []
    out = paci_cases.train_runtime(ctx, rt, iters, n, forward_step_func, logged=losses_hex,
                                   after_call=lambda: scales.append(scale_of(ctx)))
    return out, scales


def summary(ctx, rt, losses, scales, **extra):
    finite = all(bool(torch.isfinite(p).all()) for c in ctx["model"] for p in c.parameters())
    return dict(stage=rt.stage, losses=losses, scales=scales, ok=[s.update_successful for s in
                rt.steps], grad_norms=[s.grad_norm for s in rt.steps], drift=rt.drift.max,
                bound=rt.drift.bound, steps=rt.drift.version, skipped=rt.skipped_steps,
                weights_finite=finite, digest=digest(ctx["model"]), **extra)


# --- cases ------------------------------------------------------------------------------------

def case_flush_equals_stock(out_dir, name, **kw):
    """The flush runtime (grad metadata on) == stock 1F1B + optimizer.step(), bit for bit."""
    iters, n = 5, 4
    ctx = setup(**kw)
    stock, stock_scales, stock_ok = train_stock(ctx, iters, n)
    stock_digest = digest(ctx["model"])
    ctx = setup(**kw)
    rt = make_runtime(ctx, "flush", n)
    flush, scales = train_runtime(ctx, rt, iters, n)
    finish(name, out_dir, summary(ctx, rt, flush, scales, stock=stock, stock_scales=stock_scales,
                                  stock_ok=stock_ok, stock_digest=stock_digest))


def case_paci_trains(out_dir, name, iters=8, a=2, n=4, **kw):
    ctx = setup(**kw)
    rt = make_runtime(ctx, "paci", a)
    tokens = []
    divide = GradMeta.divide_by_tokens

    def recording(self, model, group):  # each step's token count, as the stage used it
        count = self.group_tokens  # a device tensor once counted (0 before)
        tokens.append(float(count) if torch.is_tensor(count) else count)
        return divide(self, model, group)

    GradMeta.divide_by_tokens = recording
    try:
        losses, scales = train_runtime(ctx, rt, iters, n)
    finally:
        GradMeta.divide_by_tokens = divide
    expected = [sum(kept_tokens(i, row) for i in range(k * a, k * a + a) for row in range(MBS))
                for k in range(iters * n // a)]
    finish(name, out_dir, summary(ctx, rt, losses, scales, step_tokens=tokens, a=a, n=n,
                                  expected_tokens=expected if kw.get("per_token") else None))


def _inf_into_gradient(rt, stage, mb):
    """A forward step whose output at ``stage`` for micro-batch ``mb`` gets an Inf gradient:
    only that stage's weights see it (stage 0 sends no gradient on)."""

    def forward_step(data_iterator, model):
        out, loss = build.gpt_forward_step(data_iterator, model)
        if rt.stage == stage and rt.data.current == mb:
            out.register_hook(lambda g: torch.full_like(g, float("inf")))
        return out, loss

    return forward_step


def case_fp16_overflow(out_dir, name):
    """An Inf in stage 0's gradient of micro-batch 9 (third group of 4): stage 0 skips that
    step and halves its scale (hysteresis 1); stage 1 steps; training continues finite."""
    ctx = setup(fp16=True)
    rt = make_runtime(ctx, "paci", 4)
    losses, scales = train_runtime(ctx, rt, 5, 4, _inf_into_gradient(rt, 0, 9))
    finish(name, out_dir, summary(ctx, rt, losses, scales))


def case_fp16_rescale(out_dir, name):
    """Stage 0's scaler starts at half of stage 1's: with the rescale, stage 0's unscaled
    gradients (grad norms) equal those of a run where both start equal."""
    out = {}
    for label, stage0 in (("same", None), ("half", 2.0 ** 11)):
        ctx = setup(fp16=True, stage0_scale=stage0)
        rt = make_runtime(ctx, "paci", 4)
        losses, scales = train_runtime(ctx, rt, 3, 4)
        out[label] = summary(ctx, rt, losses, scales)
    finish(name, out_dir, out)


CASES = {
    "fp16_flush_equals_stock": lambda d, n: case_flush_equals_stock(
        d, n, fp16=True, scale=2.0 ** 20, window=2, hysteresis=1),
    "fp16_paci": lambda d, n: case_paci_trains(d, n, fp16=True, window=2, scale=2.0 ** 14),
    "fp16_overflow": case_fp16_overflow,
    "fp16_rescale": case_fp16_rescale,
    "per_token_flush_equals_stock": lambda d, n: case_flush_equals_stock(d, n, per_token=True),
    "per_token_paci": lambda d, n: case_paci_trains(d, n, per_token=True),
}


def main() -> int:
    args = parse_case_args(CASES)
    for case in args.cases:
        CASES[case](args.out, case)
    build.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
