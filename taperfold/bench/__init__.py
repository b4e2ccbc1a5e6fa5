"""`taperfold bench`: the paper's Table 3 (throughput of baseline, unfused and folded models), measured
with variants alternated in rounds, the first run reported apart, and the spread of every cell recorded."""
