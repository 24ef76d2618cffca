"""What the methods that move a stage's weights along its optimizer share (the weight
prediction before each stale forward, the look-ahead after each step): the move itself, the
runs whose weights or state the flat layout cannot hold, and how their times are stated.

Pure Python at import (torch inside the move only). Each method imports these from here, never
from the other method's file.
"""

from __future__ import annotations

from typing import Callable, Optional

# Megatron-LM's flags that keep a stage's weights in FP8 (its recipe: delayed, tensorwise,
# MXFP8, blockwise) or NVFP4 format: uint8 buffers, which the flat state does not hold
# (megatron-core 0.16: --fp4-param; 0.17 on: --fp4-param-gather)
LOW_PRECISION_WEIGHTS = (("--fp8-param-gather", "fp8_param_gather"),
                         ("--fp4-param-gather", "fp4_param_gather"), ("--fp4-param", "fp4_param"))
# Megatron-LM's precision-aware optimizer and the state dtypes it takes (fp32 unless asked)
PRECISION_AWARE = ("--use-precision-aware-optimizer", "use_precision_aware_optimizer")
STATE_DTYPES = (("--main-params-dtype", "main_params_dtype"), ("--exp-avg-dtype", "exp_avg_dtype"),
                ("--exp-avg-sq-dtype", "exp_avg_sq_dtype"))


def dtype_name(value) -> str:
    """Megatron-LM's name for a dtype flag's value: the name itself before its validate_args,
    a torch dtype after it (fp8 is uint8 there)."""
    text = str(value).replace("torch.", "")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "uint8": "fp8"}.get(text,
                                                                                         text)


def flat_state_unsupported(args) -> str:
    """Why the stage's flat state that the prediction and the look-ahead move
    (``mcore/main_params.py``: the bf16/fp16 model weights, their fp32 main copies and the
    optimizer's fp32 state) does not hold this run's weights or state, with the fix ("" when
    it does). Megatron-LM's flags only: ``pretrain_gpt_paci.py`` has none of them."""
    for name, dest in LOW_PRECISION_WEIGHTS:
        if getattr(args, dest, False):
            return (f"does not move FP8 or FP4 weights ({name}): Megatron keeps them in uint8 "
                    "buffers and the pass moves bf16/fp16 weights only, so every linear "
                    "weight would stay where it is (and the prediction's clipping norm would "
                    f"miss its gradient); drop {name} to use it")
    given = [name for name, dest in (PRECISION_AWARE,) if getattr(args, dest, False)]
    given += [f"{name} {dtype_name(getattr(args, dest))}" for name, dest in STATE_DTYPES
              if getattr(args, dest, None) is not None
              and dtype_name(getattr(args, dest)) != "fp32"]
    if given:
        return (f"does not support {' and '.join(given)}: it reads and moves Megatron's fp32 "
                "main copies and fp32 optimizer state, which the precision-aware optimizer "
                "keeps inside Transformer Engine's FusedAdam instead (or in lower precision); "
                f"drop {' and '.join(g.split()[0] for g in given)} to use it")
    return ""


# the end-of-run cost lines say what their times hold (Pass.settle)
UNTIMED_COMPILE = "every move timed, none compiling: the kernels were compiled at start-up"


def versions_kept(params):
    """The in-flight graphs saved these weights; their backwards read them as they stand."""
    from ..autograd_versions import keep_version_counters

    return keep_version_counters(params)


def grad_factor(accumulation: int, backwards: int) -> float:
    """What turns the gradient buffer after ``backwards`` of a group's ``accumulation`` into
    the mean gradient of those backwards (each adds its gradient / a; the loss scale is taken
    out on the device)."""
    return accumulation / backwards


def predict_ahead(layout, steps: int, factor: Optional[float], lr_sum: Callable[[dict, int], float],
                  loss_scale=None, reduce_sumsq=None, mover=None) -> bool:
    """Write the stage's prediction ``steps`` local steps ahead into its model weights (the
    runtime's feature and the emulator both call this). ``factor``: ``grad_factor`` of the
    group so far, None to fold nothing; ``lr_sum(group, n)``: the sum of the LRs of the next
    n steps; ``loss_scale``: the gradient buffers' scale on the device (None: 1); ``mover``:
    a layer-by-layer move (``mcore/prediction_overlap.py``) that takes the coefficients and
    moves as the forward goes, else the whole stage moves now. False when there is nothing to
    predict from (SGD without momentum and without a gradient): nothing moved."""
    from .prediction_pass import host_coefficients, predict, scalars_to_device

    stage_pass = layout.stage_pass
    if stage_pass.kind == "sgd" and factor is None:
        return False
    rows = [host_coefficients(k, (lr_sum(k.group, steps), lr_sum(k.group, steps - 1)),
                              layout.step_count(k.inner), factor or 0.0)
            for k in stage_pass.klasses]
    inv_scale = None if loss_scale is None else loss_scale.reciprocal()
    fold = factor is not None
    if mover is None:
        predict(stage_pass, rows, inv_scale, fold, reduce_sumsq)
    else:
        host = scalars_to_device(rows, stage_pass.device)
        mover.start(stage_pass.coefficients(host, inv_scale, fold, reduce_sumsq), fold)
    return True
