"""Fold each constant-scale norm into the layers that read it, so the norm leaves the graph.

The pass finds its own work (`detect_norms`), asks `readers.readers_of` whether every reader can take
the norm's arithmetic, and either moves it there or leaves the norm exactly as it was.
"""

from __future__ import annotations

import onnx_ir as ir

from taperfold.norms import norm_kind
from taperfold.passes._graph import node_label, remove_if_dead
from taperfold.passes.constants import AfterConstantsPass
from taperfold.passes.detect import detect_norms
from taperfold.passes.readers import Blocked, move_into_readers, readers_of
from taperfold.passes.report import NormStatus


class FoldIntoReadersPass(AfterConstantsPass):
    """Fold every candidate norm whose readers all take it (linear layers with constant weights, shape
    readers, channel-keeping reshapes in front of those); keep the rest, with the first blocker as reason.

    Requires: constants folded (FoldConstantsPass), else a norm whose scale is computed at run time is missed.
    Ensures: nothing reads a folded norm's output; its readers read its input, their weights rewritten.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for candidate in detect_norms(model).candidates:
            match = candidate.match
            entry = self.report.entry(candidate.name, candidate.kind)
            entry.consumers = [node_label(use.node) for use in match.output.uses()]
            try:
                readers = readers_of(match.output, match)
            except Blocked as why:
                # a scale of the model's own that stays is no norm left behind: the reason says which it is
                entry.status, entry.reason = NormStatus.KEPT, "; ".join(x for x in (str(why), candidate.note) if x)
                continue
            effects = move_into_readers(model.graph, match, readers)
            remove_if_dead(model.graph, match.nodes)
            self.rewritten.append((candidate.name, match.output))
            entry.status, entry.into = NormStatus.FOLDED, "consumers"
            # "" but for a kind that keeps a part (DyT), or a scale no norm module applies
            entry.reason = "; ".join(x for x in (candidate.note, norm_kind(candidate.kind).folded_note) if x)
            entry.bytes_rewritten += effects.bytes_rewritten
            entry.copied += effects.copied
            modified = True
        return ir.passes.PassResult(model, modified)
