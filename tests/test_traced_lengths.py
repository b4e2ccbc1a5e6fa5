"""check_lengths on torch.onnx's own traces of modules that branch on a length, and of one that does not."""

import pytest
import torch

from taperfold.errors import TaperfoldError
from taperfold.traced_lengths import check_lengths, sample_lengths

WANTED = {0: ("batch", 64), 1: ("sequence", 128)}


class Windows(torch.nn.Module):
    """Sums its tokens in windows of 4, a remainder dropped, as DeepSeek-V4's compressor does; one branch for no
    window at all and one for a single window."""

    def forward(self, x):
        usable = (x.shape[1] // 4) * 4
        if usable == 0:
            return x.sum(1)
        windows = x[:, :usable].reshape(x.shape[0], usable // 4, 4, -1).sum(2)
        if windows.shape[1] == 1:
            return windows[:, 0]
        return windows.mean(1)


class Plain(torch.nn.Module):
    """Branch-free, broadcasting a per-batch scale: traced as if the batch were never 1, which ONNX handles alike."""

    def forward(self, x):
        scale = x.mean((1, 2), keepdim=True).expand(x.shape[0], 1, x.shape[2])
        return (x * scale).cumsum(1)


def _trace(module):
    batch = torch.export.Dim("batch", min=1, max=WANTED[0][1])
    sequence = torch.export.Dim("sequence", min=1, max=WANTED[1][1])
    program = torch.onnx.export(
        module.eval(), (torch.randn(2, 8, 3),), dynamo=True, dynamic_shapes=({0: batch, 1: sequence},), verbose=False
    )
    return program.exported_program


def test_a_trace_of_one_branch_of_a_length_is_refused_naming_what_it_assumed():
    # traced at 8 tokens (two windows): torch.export keeps that branch, assumes at least 8 tokens, and torch.onnx drops
    # the assertion, so the graph would average windows where the module returns the sum or the one window
    with pytest.raises(TaperfoldError) as refused:
        check_lengths(_trace(Windows()), WANTED, "x")
    message = str(refused.value)
    assert "holds for some sequence lengths of 'x' only" in message, message
    assert "which is false at sequence 1 (asked: 1 to 128)" in message, message


def test_a_branch_free_trace_that_broadcasts_a_batch_passes():
    check_lengths(_trace(Plain()), WANTED, "x")


def test_sampled_lengths_hold_each_short_one_and_each_power_of_two_with_its_neighbours():
    assert sample_lengths(4096, all_up_to=4) == [
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        9,
        15,
        16,
        17,
        31,
        32,
        33,
        63,
        64,
        65,
        127,
        128,
        129,
        255,
        256,
        257,
        511,
        512,
        513,
        1023,
        1024,
        1025,
        2047,
        2048,
        2049,
        4095,
        4096,
    ]
    assert sample_lengths(10, all_up_to=64) == list(range(1, 11))


@pytest.mark.parametrize("graph", ["prefill", "growing", "static"])
def test_each_graphs_dynamic_axes_are_the_ones_torch_export_infers(graph):
    """torch.onnx traces a module again, with the bounds torch.export suggests, when the declared ones are wider than
    what the model's code allows (a past that leaves no room for a new token): each graph is declared so as to be
    traced once."""
    from taperfold.models import random_gate0_model
    from taperfold.tracing import ExportOptions, trace_call

    call = trace_call(random_gate0_model("tiny"), ExportOptions(), graph)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # as torch.onnx's capture runs it
        torch.export.export(call.module, call.args, kwargs=call.kwargs, dynamic_shapes=call.shapes, strict=False)
