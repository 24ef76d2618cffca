"""--optimizer nadam: torch's NAdam behind Megatron-Core's optimizer wrappers.

Megatron-Core 0.16-0.19 build Adam or SGD only. ``use_nadam`` lets Megatron build its Adam
(the wrappers, the fp32 main copies, the distributed optimizer's shards and its grad-norm
clipping all stay Megatron's) and then puts NAdam in the place of the inner torch optimizer,
over the same parameter groups, so that Megatron's LR scheduler, its weight-decay multipliers
and its state writes reach NAdam as they reached Adam.

NAdam keeps Adam's state (``exp_avg``, ``exp_avg_sq``, ``step``) plus ``mu_product``, the
running product of its momentum schedule mu_t = beta1 (1 - 0.5 x 0.96^(t psi)). Megatron knows
Adam's state only: the distributed optimizer makes every per-parameter state tensor but 'step'
a shard of the parameter's shape, and its load (and the placeholder step before one) writes
Adam's keys alone. So between steps ``MegatronNAdam``'s state is Adam's: ``mu_product`` is put
in for torch's step only, computed from the step count with the same float32 products torch's
own steps take, so a resumed run equals the uninterrupted one bit for bit. The recipe studied
(study 14): Ajanthan et al., ICML 2025 (arXiv 2505.01099), NAdam with beta1 0.99 and decoupled
weight decay on asynchronous pipelines.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..features.base import sub_optimizers

MOMENTUM_DECAY = 0.004  # torch's default psi
_LAST: Dict[tuple, Tuple[int, float]] = {}  # (beta1, psi, dtype) -> the last (step, product)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch keeps an optimizer's scalars in (its _get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def mu_product_at(step: float, beta1: float, momentum_decay: float = MOMENTUM_DECAY,
                  dtype: Optional[torch.dtype] = None) -> float:
    """NAdam's mu_product after ``step`` steps as torch's own steps leave it, bit for bit: the
    same float32 scalar multiplications. The last one asked is kept, so a run pays one
    multiplication a step (and a load its step count once)."""
    dtype = dtype or _scalar_dtype()
    key, step = (float(beta1), float(momentum_decay), dtype), int(step)
    done, value = _LAST.get(key, (0, 1.0))
    if done > step:
        done, value = 0, 1.0
    if done < step:
        product = torch.tensor(value, dtype=dtype)
        for t in range(done + 1, step + 1):
            product.mul_(beta1 * (1.0 - 0.5 * (0.96 ** (float(t) * momentum_decay))))
        value = product.item()  # a CPU tensor made here: no device sync
    _LAST[key] = (step, value)
    return value


class MegatronNAdam(torch.optim.NAdam):
    """torch's NAdam whose state is Adam's between steps. Each group counts its steps in
    ``group["step"]`` (where Apex's and TE's fused Adam keep it, so Megatron saves and restores
    it on every path); before torch's step each started parameter gets that step as its own
    tensor and the ``mu_product`` of it, which is dropped again after the step."""

    def __setstate__(self, state):
        # torch's NAdam would convert each parameter's 'step' and 'mu_product' here and needs
        # both; here they come from the group's count at the next step
        torch.optim.Optimizer.__setstate__(self, state)
        for group in self.param_groups:
            for key, value in (("maximize", False), ("foreach", None), ("capturable", False),
                               ("differentiable", False), ("decoupled_weight_decay", False)):
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure=None):
        counts = [self._prepare(group) for group in self.param_groups]
        try:
            loss = super().step(closure)
        finally:
            for state in self.state.values():
                state.pop("mu_product", None)
        for group, count in zip(self.param_groups, counts):
            stepped = any(p.grad is not None for p in group["params"])
            group["step"] = count + 1 if stepped else count
        return loss

    def _prepare(self, group) -> float:
        """The group's step count; its parameters' 'step' and 'mu_product' set from it (host
        scalars only: torch keeps both on the CPU and reads 'step' each step itself)."""
        started = [self.state[p] for p in group["params"] if self.state.get(p)]
        count = group.get("step")
        if count is None:  # once, after loading torch Adam's per-parameter steps (CPU tensors)
            count = max((float(s["step"]) for s in started if "step" in s), default=0.0)
        count = float(count)  # a Python number: this class writes it, Megatron's load restores it
        dtype = _scalar_dtype()
        product = mu_product_at(count, group["betas"][0], group["momentum_decay"], dtype)
        for state in started:
            # a fresh tensor each: a load may leave one shared by all, which torch's in-place
            # increment would advance once per parameter
            state["step"] = torch.tensor(count, dtype=dtype)
            state["mu_product"] = torch.tensor(product, dtype=dtype)
        return count


def use_nadam(optimizer, decoupled_weight_decay: bool = True,
              momentum_decay: float = MOMENTUM_DECAY) -> None:
    """Replace the Adam inside each of Megatron's (chained) optimizers by NAdam over the same
    groups and state; the groups keep their lr, betas, eps and weight decay."""
    for sub in sub_optimizers(optimizer):
        adam = sub.optimizer
        if not isinstance(adam, torch.optim.Optimizer) or "betas" not in adam.defaults:
            raise TypeError(f"--optimizer nadam replaces Megatron's Adam; got "
                            f"{type(adam).__name__}")
        nadam = MegatronNAdam(adam.param_groups, lr=adam.defaults["lr"],
                              betas=adam.defaults["betas"], eps=adam.defaults["eps"],
                              weight_decay=adam.defaults["weight_decay"],
                              momentum_decay=momentum_decay,
                              decoupled_weight_decay=decoupled_weight_decay)
        for group in nadam.param_groups:  # Adam's groups carry Adam's own setting of it
            group["decoupled_weight_decay"] = decoupled_weight_decay
            group["momentum_decay"] = momentum_decay
        nadam.state = adam.state
        sub.optimizer = nadam
