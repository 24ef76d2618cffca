"""Where Megatron-Core keeps a stage's fp32 main copies and optimizer state, laid out flat for
the weight prediction's pass (``features/prediction_pass.py``), and how a model weight is made
again from them.

Megatron's DDP keeps each stage's gradients in flat buffers (``_ParamAndGradBuffer``, one per
dtype). The prediction reads, element for element, the model weight, its fp32 main copy, the
optimizer's state and the gradient; laid out as in the gradient buffer, the whole stage is a
few contiguous pieces that one kernel each can move. So, once per stream (``StageLayout``):

* the main copies (``Float16OptimizerWithFloat16Params``: whole; the distributed optimizer:
  this rank's shard of each bucket) and their optimizer state are re-homed into flat fp32
  buffers in the gradient buffer's order (``tensor.data`` points into them; nothing is
  copied twice, the old storage is freed);
* without the distributed optimizer the bf16/fp16 model weights are re-homed the same way
  (the distributed optimizer already keeps them in the buffer's ``param_data``);
* torch's optimizers get their state made up front, as their first step would make it
  (zeros, step 0: the same numbers), so that the first step can be predicted too.

A checkpoint load replaces the optimizer's state tensors; the layout notices it (by storage)
when the next stream starts and re-homes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import param_is_not_shared

from ..features.base import sub_optimizers
from ..features.prediction_pass import Klass, Minor, Pass, Piece, kernel_choice
from ..flag import ConfigError

STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd_momentum": ("momentum_buffer",),
               "sgd": ()}
BIG_RUN = 1 << 16  # a run of another class at least this long is a piece of its own


@dataclass
class _Main:
    """One main copy (or shard) and where it sits in its piece."""

    model: torch.nn.Parameter
    main: torch.Tensor
    opt: object  # Megatron's optimizer holding it
    group: dict
    start: int  # offset in the piece
    end: int
    fold: bool = True
    in_norm: bool = True


@dataclass
class _Region:
    """One piece before it is cut: the gradient and target views, its mains."""

    grad: torch.Tensor
    target: Optional[torch.Tensor]  # None: the model weights are to be re-homed
    mains: List[_Main] = field(default_factory=list)


def optimizer_kind(inner) -> str:
    """"adam", "sgd_momentum" or "sgd"; ConfigError for what the prediction cannot follow."""
    name = type(inner).__name__
    kinds = set()
    for group in inner.param_groups:
        if "momentum_decay" in group:  # NAdam's groups have Adam's keys too
            raise ConfigError("the weight prediction and the look-ahead follow Adam's and "
                              f"SGD's steps, not {name}'s")
        if "betas" in group:
            if group.get("amsgrad"):
                raise ConfigError("--paci-weight-prediction does not predict AMSGrad steps")
            kinds.add("adam")
        elif "momentum" in group:
            if group.get("dampening", 0.0):
                raise ConfigError("--paci-weight-prediction predicts SGD without dampening only")
            kinds.add("sgd_momentum" if group["momentum"] else "sgd")
        else:
            raise ConfigError(f"--paci-weight-prediction predicts Adam's and SGD's steps; "
                              f"{name} is neither")
    if len(kinds) != 1:
        raise ConfigError(f"--paci-weight-prediction needs one optimizer kind per stage, "
                          f"{name} mixes {sorted(kinds)}")
    return kinds.pop()


def _decoupled(inner, group) -> bool:
    """AdamW's decay (on the weight) or Adam's L2 (in the gradient, hence in the moments)."""
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    if hasattr(inner, "adam_w_mode"):  # Apex / Transformer Engine FusedAdam
        return bool(inner.adam_w_mode)
    return isinstance(inner, torch.optim.AdamW)


def check_optimizer(optimizer) -> str:
    """The stage's optimizer kind, or ConfigError where the prediction cannot run on it."""
    kinds = set()
    for opt in sub_optimizers(optimizer):
        config = getattr(opt, "config", None)
        if getattr(config, "use_precision_aware_optimizer", False):
            raise ConfigError("--paci-weight-prediction and --paci-lookahead need Megatron's "
                              "fp32 main copies, which --use-precision-aware-optimizer does not "
                              "keep: drop it, or run --no-paci-weight-prediction without "
                              "--paci-lookahead")
        if not (hasattr(opt, "fp32_from_float16_groups")
                or hasattr(opt, "shard_fp32_from_float16_groups")):
            raise ConfigError("--paci-weight-prediction found no fp32 main copy in the stage's "
                              "optimizer: train with --bf16 or --fp16")
        kinds.add(optimizer_kind(opt.optimizer))
    if len(kinds) != 1:
        raise ConfigError(f"--paci-weight-prediction needs one optimizer kind per stage, found "
                          f"{sorted(kinds)}")
    return kinds.pop()


def _buffers(model) -> list:
    """The stage's bf16/fp16 gradient buffers. FP8 and FP4 weights (uint8 buffers) would be
    left out, unpredicted and missing from the clipping norm: the flags refuse them
    (``weight_prediction.flat_state_unsupported``), and so does this, should one get here."""
    every = list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers",
                                                               []))
    if any(b.param_dtype not in (torch.bfloat16, torch.float16, torch.float32) for b in every):
        raise ConfigError("--paci-weight-prediction and --paci-lookahead move bf16/fp16 weights "
                          "only, not FP8 or FP4 ones (--fp8-param-gather, --fp4-param-gather): "
                          "drop that flag, or run --no-paci-weight-prediction without "
                          "--paci-lookahead")
    return [b for b in every if b.param_dtype in (torch.bfloat16, torch.float16)]


def _tp_partial(name: str, param, config, tp_size: int) -> bool:
    """Weights whose gradient finalize_model_grads still reduces over tensor parallel
    (megatron/core/distributed/finalize_model_grads.py, _allreduce_non_tensor_model_parallel_
    grads): until then each tensor-parallel rank holds a different part."""
    if tp_size <= 1:
        return False
    return bool(getattr(param, "average_gradients_across_tp_domain", False)
                or (getattr(config, "sequence_parallel", False)
                    and getattr(param, "sequence_parallel", False))
                or (getattr(config, "qk_layernorm", False)
                    and ("q_layernorm" in name or "k_layernorm" in name)))


class StageLayout:
    """The stage's prediction state, flat (see the module docstring), and the ``Pass`` over it.

    ``partial``: weights whose gradient is complete only later (stage 0's tied embedding: its
    output-layer half joins at RG); they fold nothing. ``cp_size`` > 1: every gradient is
    partial per context-parallel rank, so nothing is folded (the ranks of one sequence must
    run on the same weights)."""

    def __init__(self, model, optimizer, *, partial: Sequence[torch.Tensor] = (), cp_size: int = 1,
                 tp_group=None):
        self.kind = check_optimizer(optimizer)
        self.model, self.optimizer = model, optimizer
        self.partial = {id(p) for p in partial}
        self.cp_size = cp_size
        self.tp_group = tp_group
        self._homes: List[Tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None],
                                torch.Tensor]] = []
        # id(model weight) -> [(piece, lo, hi)]: its elements (this rank's, with the
        # distributed optimizer) in the pieces
        self.where: Dict[int, List[Tuple[int, int, int]]] = {}
        self.sharded = False
        self.stage_pass = self._build()
        self._steps = self._read_steps()

    # building --------------------------------------------------------------------------------
    def _build(self) -> Pass:
        config = getattr(self.model, "config", None)
        tp_size = 1 if self.tp_group is None else self.tp_group.size()
        names = {id(p): n for n, p in self.model.named_parameters()}
        regions = self._regions()
        klasses: Dict[tuple, int] = {}
        klass_list: List[Klass] = []
        pieces: List[Piece] = []
        excluded: List[torch.Tensor] = []
        for region in regions:
            for m in region.mains:
                m.fold = (self.cp_size == 1 and id(m.model) not in self.partial
                          and not _tp_partial(names.get(id(m.model), ""), m.model, config, tp_size))
                m.in_norm = (param_is_not_shared(m.main) and tensor_parallel.
                             param_is_not_tensor_parallel_duplicate(m.main, self.tp_group))
            flat = self._rehome(region)
            for m in region.mains:
                key = (id(m.opt), id(m.group), m.fold)
                if key not in klasses:
                    klasses[key] = len(klass_list)
                    klass_list.append(Klass(self.kind, m.group, m.opt.optimizer, m.fold,
                                            _decoupled(m.opt.optimizer, m.group),
                                            float(m.opt.config.clip_grad or 0.0)))
                if not m.in_norm:
                    excluded.append(flat[3][m.start:m.end])
            runs = [(m.start, m.end, klasses[(id(m.opt), id(m.group), m.fold)])
                    for m in region.mains]
            cut = _cut(runs, *flat)
            for m in region.mains:  # where each weight's elements sit, piece by piece
                for index, (lo, hi) in enumerate(cut.bounds, start=len(pieces)):
                    if m.start < hi and m.end > lo:
                        self.where.setdefault(id(m.model), []).append(
                            (index, max(m.start, lo) - lo, min(m.end, hi) - lo))
            pieces += cut.pieces
        stage_pass = Pass(self.kind, pieces, klass_list, excluded,
                          kernel_choice(pieces[0].main.device.type, strict=False)
                          if pieces else "plain")
        return stage_pass

    def _regions(self) -> List[_Region]:
        """One region per gradient buffer (per bucket shard with the distributed optimizer)."""
        mains = {}  # id(model param) -> (main, optimizer, group)
        for opt in sub_optimizers(self.optimizer):
            group_of = {id(p): g for g in opt.optimizer.param_groups for p in g["params"]}
            if hasattr(opt, "shard_fp32_from_float16_groups"):
                pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
            else:
                pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups)
            for models, shards in pairs:
                for model, main in zip(models, shards):
                    mains[id(model)] = (main, opt, group_of[id(main)])
        regions = []
        for buf in _buffers(self.model):
            if buf.param_data is None:
                regions.append(self._whole_region(buf, mains))
            else:
                regions += self._shard_regions(buf, mains)
                self.sharded = True
        if not regions:
            raise ConfigError("--paci-weight-prediction found no bf16/fp16 gradient buffer in "
                              "the stage's model (Megatron's DDP)")
        return regions

    @staticmethod
    def _whole_region(buf, mains) -> _Region:
        region = _Region(buf.grad_data, None)
        for param, (start, end, _bucket) in buf.param_index_map.items():
            if id(param) not in mains:
                raise ConfigError("--paci-weight-prediction: a bf16/fp16 weight of the stage has "
                                  "no fp32 main copy in its optimizer")
            main, opt, group = mains[id(param)]
            region.mains.append(_Main(param, main, opt, group, start, end))
        region.mains.sort(key=lambda m: m.start)
        return region

    @staticmethod
    def _shard_regions(buf, mains) -> List[_Region]:
        """The distributed optimizer: this rank's shard of each bucket (as Megatron-Core's
        DistributedOptimizer._build_model_gbuf_range cuts it)."""
        ranks = buf.data_parallel_group.size()
        rank = buf.data_parallel_group.rank()
        regions = []
        for bucket in buf.buckets:
            size = bucket.grad_data.numel() // ranks
            lo = bucket.offset + rank * size
            hi = lo + size
            region = _Region(buf.grad_data[lo:hi], buf.param_data[lo:hi])
            for param in bucket.params_list:
                if id(param) not in mains:
                    continue  # no part of it in this rank's shard
                main, opt, group = mains[id(param)]
                world = opt._get_model_param_range_map(param)["gbuf_world"]
                region.mains.append(_Main(param, main, opt, group, world.start - lo,
                                          world.end - lo))
            region.mains.sort(key=lambda m: m.start)
            regions.append(region)
        return regions

    def _rehome(self, region: _Region):
        """Flat fp32 main copy and state (and model weights without the distributed
        optimizer) for the region, the tensors pointed into them: (target, main, state,
        grad)."""
        numel = region.grad.numel()
        device = region.grad.device
        main_flat = torch.zeros(numel, dtype=torch.float32, device=device)
        names = STATE_NAMES[self.kind]
        state_flat = tuple(torch.zeros(numel, dtype=torch.float32, device=device) for _ in names)
        target = region.target
        if target is None:
            target = torch.empty(numel, dtype=region.mains[0].model.dtype, device=device)
        for m in region.mains:
            self._home(lambda m=m: m.main, m.main, main_flat[m.start:m.end])
            if region.target is None:
                self._home(lambda m=m: m.model, m.model, target[m.start:m.end])
            state = _state_of(m.opt.optimizer, m.main, self.kind)
            for name, flat in zip(names, state_flat):
                if name in state:
                    self._home_state(m.opt.optimizer, m.main, name, flat[m.start:m.end])
        return target, main_flat, state_flat, region.grad

    def _home(self, get, tensor: torch.Tensor, view: torch.Tensor) -> None:
        def put(value, view=view):
            with torch.no_grad():
                view.copy_(value.detach().reshape(-1))
            value.data = view.view(value.shape)

        put(tensor)
        self._homes.append((get, put, view))

    def _home_state(self, inner, main, name: str, view: torch.Tensor) -> None:
        def get():
            return inner.state[main][name]

        def put(value, inner=inner, main=main, name=name, view=view):
            with torch.no_grad():
                view.copy_(value.detach().reshape(-1))
            inner.state[main][name] = view.view(main.shape)

        put(get())
        self._homes.append((get, put, view))

    def rehome(self) -> int:
        """Point every tensor that was replaced since (a checkpoint load: the optimizer's
        state) back into the flat layout, copying its values in; returns how many moved."""
        moved = 0
        for get, put, view in self._homes:
            tensor = get()
            if tensor.data_ptr() != view.data_ptr() or tensor.numel() != view.numel():
                put(tensor)
                moved += 1
        self._steps = self._read_steps()
        return moved

    def pieces_of(self, params) -> List[Piece]:
        """The elements of ``params`` (one layer's, say) as slices of the pieces, contiguous
        runs merged: what a layer-by-layer move moves."""
        spans = sorted(span for p in params for span in self.where.get(id(p), ()))
        merged: List[List[int]] = []
        for index, lo, hi in spans:
            if merged and merged[-1][0] == index and merged[-1][2] == lo:
                merged[-1][2] = hi
            else:
                merged.append([index, lo, hi])
        return [self.stage_pass.sliced(index, lo, hi) for index, lo, hi in merged]

    # what a prediction reads -----------------------------------------------------------------
    def _read_steps(self) -> Dict[int, int]:
        """Each optimizer's steps so far (the next step's bias correction), read once here
        (a device read where torch keeps the count there), then counted by ``on_step``."""
        steps = {}
        for opt in sub_optimizers(self.optimizer):
            inner = opt.optimizer
            count = int(inner.param_groups[0].get("step", 0))  # Apex / TE keep it per group
            for group in inner.param_groups:
                for main in group["params"]:
                    step = inner.state.get(main, {}).get("step")
                    if step is not None:
                        count = int(step)
                        break
                else:
                    continue
                break
            steps[id(inner)] = count
        return steps

    def step_count(self, inner) -> int:
        return self._steps[id(inner)]

    def on_step(self, successful: bool) -> None:
        """A local step ran: a successful one counts (a skipped one never reaches the inner
        optimizer)."""
        if successful:
            for key in self._steps:
                self._steps[key] += 1


def _state_of(inner, main, kind: str) -> dict:
    """The optimizer's state of ``main``, made as torch's own first step would make it where
    it does not exist yet (torch's optimizers only)."""
    state = inner.state[main]
    if state or not isinstance(inner, (torch.optim.Adam, torch.optim.SGD)):
        return state
    if kind == "adam":
        group = next(g for g in inner.param_groups if any(p is main for p in g["params"]))
        on_device = group.get("capturable") or group.get("fused")
        state["step"] = (torch.zeros((), dtype=torch.float32, device=main.device) if on_device
                         else torch.tensor(0.0, dtype=torch.float32))
        state["exp_avg"] = torch.zeros_like(main)
        state["exp_avg_sq"] = torch.zeros_like(main)
    elif kind == "sgd_momentum":
        # torch's first step sets the buffer to the gradient; momentum x 0 + gradient is the
        # same number (no dampening)
        state["momentum_buffer"] = torch.zeros_like(main)
    return state


@dataclass
class _Cut:
    pieces: List[Piece]
    bounds: List[Tuple[int, int]]  # each piece's elements in the region


def _cut(runs: Sequence[Tuple[int, int, int]], target, main, state, grad) -> _Cut:
    """The region as pieces: its most common class covers it, runs of another class at least
    BIG_RUN long are pieces of their own, shorter ones are listed by index."""
    numel = main.numel()
    sizes: Dict[int, int] = {}
    for start, end, klass in runs:
        sizes[klass] = sizes.get(klass, 0) + end - start
    base = max(sizes, key=sizes.get)
    cuts = [(start, end, klass) for start, end, klass in runs
            if klass != base and end - start >= BIG_RUN]
    bounds, lo = [], 0
    for start, end, klass in cuts:
        if start > lo:
            bounds.append((lo, start, base))
        bounds.append((start, end, klass))
        lo = end
    if lo < numel:
        bounds.append((lo, numel, base))
    pieces = []
    for lo, hi, klass in bounds:
        minors: Dict[int, List[torch.Tensor]] = {}
        for start, end, other in runs:
            if other != klass and start >= lo and end <= hi:
                minors.setdefault(other, []).append(
                    torch.arange(start - lo, end - lo, device=main.device))
        pieces.append(Piece(target[lo:hi], main[lo:hi], tuple(s[lo:hi] for s in state),
                            grad[lo:hi], klass,
                            tuple(Minor(torch.cat(ix), k) for k, ix in sorted(minors.items()))))
    return _Cut(pieces, [(lo, hi) for lo, hi, _klass in bounds])


def lr_sum(scheduler, increment: Optional[int], group: dict, steps: int) -> float:
    """The sum of the LRs of ``group``'s next ``steps`` steps: the next one is set already,
    the later ones are what Megatron's scheduler will set after each ``increment`` samples
    (read from it, then put back)."""
    if steps <= 0:
        return 0.0
    if scheduler is None or not increment or steps == 1:
        return steps * group["lr"]
    total, saved = group["lr"], scheduler.num_steps
    try:
        for ahead in range(1, steps):
            scheduler.num_steps = saved + ahead * increment
            total += scheduler.get_lr(group)
    finally:
        scheduler.num_steps = saved
    return total


def loss_scale_tensor(optimizer):
    """The gradient buffers' loss scale on the device, None without a scaler (bf16)."""
    if all(getattr(opt, "grad_scaler", None) is None for opt in sub_optimizers(optimizer)):
        return None
    return optimizer.get_loss_scale()


def reduce_over(tensor: torch.Tensor, group) -> None:
    """Sum ``tensor`` over ``group`` in place (nothing to do for one rank)."""
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(tensor, group=group)


def gather_weights(optimizer) -> None:
    """The distributed optimizer: bring every rank's shard into the stage's weights (the
    all-gather its step runs); nothing to do otherwise."""
    for opt in sub_optimizers(optimizer):
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            for chunk in opt.model_chunks:
                chunk.start_param_sync(force_sync=True)
