"""Text time per token while an answer streams: decoding the whole answer again at every
token (how the text was streamed before) against the incremental text (engine/generation.py's
TextStream), over one 4,000-token answer of the embedded SmolLM2's tokenizer.

    python benchmarks/stream_text.py [--tokens 4000] [--window 500]

The answer is the embedded model's tokens of a multilingual text (characters split over
tokens included). Prints one JSON line: for each way, the mean microseconds of text work
per token over the first and the last ``--window`` tokens, and whether both streamed
exactly the whole answer's decode.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from spmd_cp.engine.generation import TextStream
from spmd_cp.models.gguf import build_tokenizer, default_model_path

TEXT = ("Grüße aus Köln: 日本語のテキスト, emoji 🙂🚀, naïve café. Ελληνικά και русский. "
        "The quick brown fox jumps over the lazy dog. ")


class WholeDecodeStream:
    """The stream as it was: decode every token so far, hold back the possible start of a
    stop string and a trailing U+FFFD, emit the rest."""

    def __init__(self, tokenizer, stop, write):
        self.tokenizer, self.stop, self.write = tokenizer, stop, write
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted, self.text = 0, ""

    def push(self, tokens) -> bool:
        self.text = self.tokenizer.decode(tokens)
        hits = [self.text.find(s) for s in self.stop if s in self.text]
        if hits:
            self.text = self.text[:min(hits)]
            self._emit(len(self.text))
            return True
        safe = len(self.text) - self.holdback
        while safe > self.emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        self._emit(safe)
        return False

    def finish(self):
        self._emit(len(self.text))

    def _emit(self, upto):
        if upto > self.emitted:
            self.write(self.text[self.emitted:upto])
        self.emitted = max(self.emitted, upto)


def per_token_us(stream_class, tokenizer, ids, stop) -> tuple[list[float], str]:
    pieces = []
    stream = stream_class(tokenizer, stop, pieces.append)
    seconds = []
    answer = []  # one growing list, as the generation loop keeps it
    for token in ids:
        answer.append(token)
        start = time.perf_counter()
        stream.push(answer)
        seconds.append(time.perf_counter() - start)
    stream.finish()
    return [s * 1e6 for s in seconds], "".join(pieces)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--window", type=int, default=500)
    args = parser.parse_args()
    _, meta = mx.load(default_model_path(), return_metadata=True)
    tokenizer = build_tokenizer(meta)
    one = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = (one * (args.tokens // len(one) + 1))[:args.tokens]
    expected = tokenizer.decode(ids)
    stop = ["</answer>"]  # never in the text: every token is searched, nothing stops it
    result = {"tokens": len(ids), "window": args.window}
    for name, stream_class in (("whole_decode", WholeDecodeStream), ("incremental", TextStream)):
        times, written = per_token_us(stream_class, tokenizer, ids, stop)
        first, last = times[:args.window], times[-args.window:]
        result[name] = {"first_us_per_token": round(sum(first) / len(first), 1),
                        "last_us_per_token": round(sum(last) / len(last), 1),
                        "total_s": round(sum(times) / 1e6, 3),
                        "streamed_the_whole_decode": written == expected.rstrip("\ufffd")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
