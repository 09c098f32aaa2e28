"""A program defined once keeps working across pw.shutdown() and a new pw.init()."""

import torch

import pathways_torch as pw


@pw.program
def double(x):
    return x * 2


def test_a_program_is_compiled_again_for_a_new_cluster():
    for _ in range(2):          # the second cluster hands out the same slice ids
        pw.init(devices_per_host=2, timeout=60)
        try:
            s = pw.slice((2,))
            assert double(pw.put(torch.arange(4.), s)).torch().tolist() == [0, 2, 4, 6]
        finally:
            pw.shutdown()
