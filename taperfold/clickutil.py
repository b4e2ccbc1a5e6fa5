"""Small click additions for the command line."""

from __future__ import annotations

import math

import click


class AliasedOption(click.Option):
    """An option whose old spellings (`aliases`) still work but are left out of --help.

    Usage: @click.option("-o", "--output", "--out", "out", cls=AliasedOption, aliases=("--out",))
    """

    def __init__(self, *args, aliases: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.aliases = set(aliases)

    def get_help_record(self, ctx: click.Context):
        opts = self.opts
        self.opts = [o for o in opts if o not in self.aliases]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and ±inf: a nan passes every comparison a range makes."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


SEED = click.IntRange(0, 2**32 - 1)  # what numpy's and torch's seeding both take
