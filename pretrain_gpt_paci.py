"""Pretrain a GPT on Megatron-Core with a selectable pipeline schedule.

    torchrun --nproc-per-node 2 pretrain_gpt_paci.py --pipeline-schedule paci

Flags follow Megatron-LM's pretrain_gpt.py; ``--pipeline-schedule {1f1b,interleaved,paci}``,
``--paci-accumulation-factor`` and ``--paci-max-drift`` are PACI's. Bad flags fail here, before
any process group starts.
"""

import sys

from paci_megatron.arguments import parse_and_validate
from paci_megatron.quiet import fallback_notice, is_rank0


def main(argv=None) -> int:
    args, opts = parse_and_validate(argv)
    notice = fallback_notice()
    if notice and is_rank0():
        print(notice, flush=True)
    from paci_megatron.training import run  # imports Megatron: after the flags are checked

    return run(args, opts)


if __name__ == "__main__":
    sys.exit(main())
