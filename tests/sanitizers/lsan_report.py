"""Classify LeakSanitizer reports: a leak is ours when one of its first allocation-site frames is in
llamabind's extension, llama.cpp or ggml (not CPython or numpy, which keep module state alive at
exit). A suppression file cannot do this: LSan suppresses a leak when *any* frame matches, and every
call from Python into llamabind has CPython frames further up. Exit 1 if any leak is ours."""

import glob
import re
import sys

text = "".join(open(f).read() for f in glob.glob(sys.argv[1] + "*"))
blocks = re.split(r"\n(?=(?:Direct|Indirect) leak of)", text)[1:]
ours, others = [], 0
for b in blocks:
    m = re.match(r"(Direct|Indirect) leak of (\d+) byte", b)
    frames = re.findall(r"#\d+ 0x[0-9a-f]+ in (\S+) (\S+)", b)[1:6]  # skip the allocator itself
    if any("llamabind/_core" in mod or fn.startswith(("ggml_", "llama_", "gguf_", "lb::")) for fn, mod in frames):
        ours.append((m.group(1), int(m.group(2)), frames[:3]))
    else:
        others += 1
print(
    f"LeakSanitizer: {len(blocks)} leak reports; {others} at CPython/numpy allocation sites; "
    f"{len(ours)} in llamabind/llama/ggml"
)
for o in ours:
    print("  ours:", o)
sys.exit(1 if ours else 0)
