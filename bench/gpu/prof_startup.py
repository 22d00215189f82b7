"""Where start-up time goes on the GPU host: import profile of ``from kiln import LLM`` and a
cProfile of ``LLM(ART)`` (load, CUDA-graph capture), top functions by cumulative and own time.

    python bench/gpu/prof_startup.py ART [--out PROF.txt]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402, F401  (timed on its own)

t1 = time.perf_counter()
from kiln import LLM  # noqa: E402

t2 = time.perf_counter()
print(f"import torch {t1 - t0:.2f} s, kiln {t2 - t1:.2f} s", flush=True)
art = sys.argv[1]
pr = cProfile.Profile()
pr.enable()
llm = LLM(art)
pr.disable()
print(
    "phases:",
    {k: round(v, 2) for k, v in llm.engine.model.phases.items()} if hasattr(llm.engine, "model") else "",
)
buf = io.StringIO()
st = pstats.Stats(pr, stream=buf)
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(30)
text = buf.getvalue()
out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
if out:
    with open(out, "w") as f:
        f.write(text)
print(text[-9000:])
