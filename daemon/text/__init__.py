"""Text side of moed: tokenizer built from GGUF metadata, chat templates."""

from daemon.text.chat import CHATML_TEMPLATE, chat_template_from_metadata, render_chat, template_tokens
from daemon.text.tokenizer import PRE_TOKENIZERS, StreamDecoder, Tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "PRE_TOKENIZERS",
    "StreamDecoder",
    "Tokenizer",
    "chat_template_from_metadata",
    "render_chat",
    "template_tokens",
]
