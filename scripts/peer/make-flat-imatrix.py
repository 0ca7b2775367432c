#!/usr/bin/env python3
"""Writes a flat importance matrix for a GGUF file: every input column of every 2-D weight
equally important (llama.cpp's legacy imatrix format, which llama-quantize --imatrix
reads), so that llama-quantize makes the types it refuses without one (IQ3_XXS, IQ2_XXS,
IQ2_XS, IQ2_S, IQ1_S, IQ1_M, Q2_K_S) from a random file whose placeholder vocabulary
llama-imatrix cannot tokenize text with. A flat matrix weights every column as the
quantizer does without one; it is for speed measurements of random weights, where there
is no text to be faithful to.

    make-flat-imatrix.py MODEL.gguf OUT.dat

Needs python3 with llama.cpp's gguf package (gguf-py) and numpy.
"""
import struct
import sys

import gguf


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1].strip())
    src, out = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    # every 2-D weight but the embedding (a get_rows, no product); ne[0] is the row length
    entries = sorted(
        (t.name, int(t.shape[0]))
        for t in reader.tensors
        if len(t.shape) == 2 and t.name.endswith(".weight") and t.name != "token_embd.weight"
    )
    if not entries:
        sys.exit(f"make-flat-imatrix: {src} has no 2-D weights")
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, ncols in entries:
            raw = name.encode()
            # name, calls (1), values: the mean squared activation of each column, 1.0
            f.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, ncols))
            f.write(struct.pack(f"<{ncols}f", *([1.0] * ncols)))
        f.write(struct.pack("<i", 1))  # chunks
        dataset = b"flat"
        f.write(struct.pack("<i", len(dataset)) + dataset)
    print(f"make-flat-imatrix: wrote {out} ({len(entries)} weights)")


if __name__ == "__main__":
    main()
