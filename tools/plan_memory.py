#!/usr/bin/env python
"""GPU memory per rank and phase of a training job, its checkpoint (bytes in all and per rank, host memory,
save and load times) and the lead its time-limit stop signal needs, from its config alone (no GPU, nothing
allocated).

Runs `dapo-plan-memory` (dapo_megatron/commands/plan_memory.py, where its options are documented), so that
`python tools/plan_memory.py ...` keeps working from a checkout.
"""

import sys

from dapo_megatron.commands.plan_memory import main

if __name__ == "__main__":
    sys.exit(main())
