"""Constants and helpers shared by the grammar tests."""
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
DEEPSEEK_VOCAB = 129_280  # DeepSeek-V4 logit width
EOS = 1  # <｜end▁of▁sentence｜>



def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids
