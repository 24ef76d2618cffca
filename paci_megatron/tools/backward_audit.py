"""Check, module by module, which weights a backward pass really used.

PACI's contract: the backward of a micro-batch uses the activations its forward saved and the
stage's *current* weights (no stash, no copy). ``BackwardAudit`` verifies it without
``saved_tensors_hooks`` (which switch autograd's version check off and only see tensors that
share a parameter's storage). For every module that owns parameters and takes a
floating-point input it records, per micro-batch:

- at forward: the module's input (a copy) and its weights (a copy, for comparison only);
- at backward: the gradient arriving at its output, the gradient it passed to its input and
  the gradient of each of its own weights (tensor hooks, nothing else in autograd changes).

``verify`` then recomputes that module's vector-Jacobian product at the forward-time input
with the weights as they are *now* (``torch.func.functional_call``) and with the forward-time
weights. A module that derived a tensor from a weight in its forward (``weight + 1``, a cast, a
transposed contiguous copy) and let autograd save it would match the forward-time weights, not
the current ones, and fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch.func import functional_call

from ..schedule import Action, Op


@dataclass
class _Record:
    x: torch.Tensor  # forward-time input (copy)
    weights_fwd: Dict[str, torch.Tensor]
    weights_bwd: Optional[Dict[str, torch.Tensor]] = None
    grad_out: Optional[torch.Tensor] = None
    grad_in: Optional[torch.Tensor] = None
    grad_w: Dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Verdict:
    module: str
    mb: int
    weights_changed: bool  # a step updated this module's weights between forward and backward
    matches_current: bool  # every gradient equals the VJP with the current weights
    matches_forward_time: bool  # ... equals the VJP with the forward-time weights
    max_abs_error: float  # largest |gradient - VJP with the current weights|


def _own_params(module: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def _first_tensor(value):
    return value[0] if isinstance(value, (tuple, list)) else value


class BackwardAudit:
    """Hooks on every parameter-owning module of ``model``; call ``forward_phase(mb)`` before a
    micro-batch's forward, ``backward_phase(mb)`` before its backward and ``verify(mb)`` after
    it."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {name: m for name, m in model.named_modules() if _own_params(m)}
        self.records: Dict[Tuple[str, int], _Record] = {}
        self.mb: Optional[int] = None
        self.phase: Optional[str] = None
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self.handles.append(module.register_forward_hook(self._post_hook(name)))
            for pname, param in _own_params(module).items():
                self.handles.append(param.register_hook(self._param_hook(name, pname)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def forward_phase(self, mb: int) -> None:
        self.mb, self.phase = mb, "forward"

    def backward_phase(self, mb: int) -> None:
        self.mb, self.phase = mb, "backward"
        for (name, rec_mb), rec in self.records.items():
            if rec_mb == mb:
                rec.weights_bwd = {n: p.detach().clone()
                                   for n, p in _own_params(self.modules[name]).items()}

    def idle(self) -> None:
        self.mb, self.phase = None, None

    # hooks -------------------------------------------------------------------------------------
    def _pre_hook(self, name: str):
        def hook(module, args):
            if self.phase != "forward" or not args or not torch.is_tensor(args[0]) \
                    or not args[0].is_floating_point() or not args[0].requires_grad:
                return None
            x = args[0]
            self.records[(name, self.mb)] = _Record(
                x.detach().clone(), {n: p.detach().clone() for n, p in _own_params(module).items()})
            alias = x.view_as(x)  # its gradient is this module's input gradient alone
            alias.register_hook(self._grad_hook(name, self.mb, "grad_in"))
            return (alias,) + tuple(args[1:])
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            out = _first_tensor(output)
            if (name, self.mb) in self.records and self.phase == "forward" and out.requires_grad:
                out.register_hook(self._grad_hook(name, self.mb, "grad_out"))
        return hook

    def _grad_hook(self, name: str, mb: int, slot: str):
        def hook(grad):
            setattr(self.records[(name, mb)], slot, grad.detach().clone())
        return hook

    def _param_hook(self, name: str, pname: str):
        def hook(grad):
            record = self.records.get((name, self.mb))
            if self.phase == "backward" and record is not None:
                record.grad_w[pname] = grad.detach().clone()
        return hook

    # the check ---------------------------------------------------------------------------------
    def _vjp(self, name: str, weights: Dict[str, torch.Tensor], rec: _Record):
        module = self.modules[name]
        x = rec.x.clone().requires_grad_()
        params = {n: w.clone().requires_grad_() for n, w in weights.items()}
        phase, self.phase = self.phase, None  # our own hooks stay quiet
        try:
            out = _first_tensor(functional_call(module, params, (x,)))
            names = list(params)
            grads = torch.autograd.grad(out, [x] + [params[n] for n in names], rec.grad_out,
                                        allow_unused=True)
        finally:
            self.phase = phase
        return grads[0], {n: g for n, g in zip(names, grads[1:]) if g is not None}

    def verify(self, mb: int) -> List[Verdict]:
        """Compare every module's recorded gradients of micro-batch ``mb`` with the VJPs at its
        forward-time input, with the current and with the forward-time weights."""
        verdicts = []
        for (name, rec_mb), rec in sorted(self.records.items(), key=lambda kv: kv[0][0]):
            if rec_mb != mb or rec.grad_out is None:
                continue
            now_in, now_w = self._vjp(name, rec.weights_bwd, rec)
            then_in, then_w = self._vjp(name, rec.weights_fwd, rec)
            actual = [rec.grad_in] + [rec.grad_w.get(n) for n in now_w]
            verdicts.append(Verdict(
                module=name, mb=mb,
                weights_changed=any(not torch.equal(rec.weights_fwd[n], rec.weights_bwd[n])
                                    for n in rec.weights_fwd),
                matches_current=_all_equal(actual, [now_in] + list(now_w.values())),
                matches_forward_time=_all_equal(actual, [then_in] + [then_w.get(n) for n in now_w]),
                max_abs_error=_max_abs_error(actual, [now_in] + list(now_w.values()))))
        for key in [k for k in self.records if k[1] == mb]:
            del self.records[key]
        return verdicts


def _all_equal(actual, expected) -> bool:
    return all(a is not None and e is not None and torch.equal(a, e)
               for a, e in zip(actual, expected))


def _max_abs_error(actual, expected) -> float:
    errors = [float((a.float() - e.float()).abs().max()) for a, e in zip(actual, expected)
              if a is not None and e is not None]
    return max(errors, default=float("inf"))


def audit_backward(emulator, stage: int):
    """Attach a ``BackwardAudit`` to one stage of ``emulator``; returns the list its verdicts
    are appended to after every backward of that stage. Not for ``--recompute-granularity``
    runs (their forward is re-run inside the backward)."""
    audit = BackwardAudit(emulator.stage_model(stage))
    verdicts: list = []

    def hook(s: int, act: Action, when: str) -> None:
        if s != stage or act.op not in (Op.FORWARD, Op.BACKWARD):
            return
        if when == "after":
            audit.idle()
            if act.op is Op.BACKWARD:
                verdicts.extend(audit.verify(act.mb))
        elif act.op is Op.FORWARD:
            audit.forward_phase(act.mb)
        else:
            audit.backward_phase(act.mb)

    emulator.hooks.append(hook)
    return verdicts
