"""Where supported megatron-core releases differ in an API this package calls, detected by
feature (the installed function's signature), so a call site reads the same on each of them.
The releases themselves are listed in ``paci_megatron.patches.versions``."""

from __future__ import annotations

import functools
import inspect

from megatron.core.pipeline_parallel import schedules as mcore_schedules

# megatron-core 0.17 dropped ``model_type`` from ``backward_step(input_tensor, output_tensor,
# output_tensor_grad, model_type, config)``; 0.16 still takes it (and ignores it for GPT)
BACKWARD_STEP_TAKES_MODEL_TYPE = (
    "model_type" in inspect.signature(mcore_schedules.backward_step).parameters)


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Megatron-Core's ``backward_step`` for one micro-batch at one stage, on every supported
    release: returns the gradient of ``input_tensor`` (None at the first stage)."""
    if BACKWARD_STEP_TAKES_MODEL_TYPE:
        return mcore_schedules.backward_step(input_tensor, output_tensor, output_tensor_grad,
                                             model_type, config)
    return mcore_schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def has_batch_size_rampup() -> bool:
    """Whether megatron-core still ramps the batch size (``--rampup-batch-size``): 0.18 removed
    its calculator (the flag is deprecated there and ignored, for ``--step-batch-size-schedule``)."""
    from megatron.core import num_microbatches_calculator

    return hasattr(num_microbatches_calculator, "RampupBatchsizeNumMicroBatchesCalculator")


@functools.lru_cache(maxsize=None)
def null_tokenizer_adds_eod() -> bool:
    """Whether megatron-core's NullTokenizer counts ``--vocab-size N`` as N ids plus an
    end-of-document id (through 0.17) or as N ids, the last one the end of a document (0.18)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(vocab_size=8).vocab_size == 9
