"""Run bench/pairs.py with other launch configs of the segment-sum kernels (backends/launch.py
gather_config's BS, seg_BK, seg_warps), to time a training objective end to end under each, side by
side on one machine. bench/segment_sums.py times the kernels alone.

    python bench/segment_configs.py old --device cuda --head swiglu ...   # pairs.py's arguments follow

Names: "default" (the configs as they are), "old" (those before bench/results/h200-run4), "sweep"
(the fastest of each kind in bench/results/h200-run4's second kernel sweep).
"""
import os
import runpy
import sys

import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bst_fast.backends import launch  # noqa: E402

# (BS, seg_BK, seg_warps) by what the segment sums read: the "sum" kind, "act", "swiglu"
CONFIGS = {"default": None,
           "old": dict(sum=(16, 128, 4), act=(16, 128, 4), swiglu=(8, 128, 4)),
           "sweep": dict(sum=(64, 64, 2), act=(32, 32, 2), swiglu=(16, 64, 1))}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in CONFIGS:
        sys.exit(f"usage: segment_configs.py {{{','.join(CONFIGS)}}} [bench/pairs.py's arguments]")
    table = CONFIGS[sys.argv[1]]
    default = launch.gather_config

    def gather_config(device_type, width, kind):
        cfg = default(device_type, width, kind)
        if table is not None and device_type == "cuda":
            BS, BK, warps = table[kind]
            cfg.update(BS=BS, seg_BK=min(BK, triton.next_power_of_2(width)), seg_warps=warps)
        return cfg

    # the backends look gather_config up in the launch module when they launch: patched there
    launch.gather_config = gather_config
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, "pairs.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
