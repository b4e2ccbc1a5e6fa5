"""taperfold: fold g=0 TaperNorm layers into the next linear projection, verify the result, benchmark it."""

__version__ = "0.1.0"
