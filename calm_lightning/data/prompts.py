"""Prompt formatting shared by training and evaluation: the model's chat template, or a plain
USER/ASSISTANT format for tokenizers that have none (e.g. Vicuna v1.5)."""

from __future__ import annotations

from calm_lightning.data.records import InstructionRecord, MCQARecord, OpenQARecord

OPTION_LETTERS = "ABCDEFGHIJ"
MCQA_INSTRUCTION = "Answer with the letter of the correct option ({letters})."
OPENQA_INSTRUCTION = "Answer the question with a short answer of a few words."
# Vicuna v1.1+ conversation format, used when a tokenizer ships no chat template.
PLAIN_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions."
)


def render_prompt(tokenizer, user_text: str) -> str:
    """The text a model sees before it starts its answer to `user_text`."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
    bos = tokenizer.bos_token or ""
    return f"{bos}{PLAIN_SYSTEM} USER: {user_text} ASSISTANT:"


def render_conversation(tokenizer, user_text: str, answer: str) -> tuple[str, str]:
    """(prompt, response) texts whose concatenation is the full conversation.

    The response includes the template's end-of-turn marker so the model learns to stop.
    """
    prompt = render_prompt(tokenizer, user_text)
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}],
            tokenize=False,
        )
        if not full.startswith(prompt):
            raise ValueError(
                "the chat template renders the prompt differently with and without the answer; "
                "cannot separate response tokens for the loss mask"
            )
        return prompt, full[len(prompt) :]
    return prompt, f" {answer}{tokenizer.eos_token or ''}"


def instruction_user_text(record: InstructionRecord) -> str:
    """Alpaca's instruction, with its optional input appended as context."""
    if record.input.strip():
        return f"{record.instruction}\n\n{record.input}"
    return record.instruction


def mcqa_user_text(record: MCQARecord) -> str:
    """Question, lettered options and the instruction to answer with a letter."""
    letters = OPTION_LETTERS[: len(record.choices)]
    options = "\n".join(
        f"{letter}. {text}" for letter, text in zip(letters, record.choices, strict=True)
    )
    listed = ", ".join(letters[:-1]) + f" or {letters[-1]}"
    return f"{record.question}\n\n{options}\n\n{MCQA_INSTRUCTION.format(letters=listed)}"


def mcqa_plain_prompt(record: MCQARecord) -> str:
    """The MCQA prompt without any chat template, ending where the answer letter goes: what a
    pre-trained (base) model reads as the post-hoc reference (`reference_prompt: plain`)."""
    return f"{mcqa_user_text(record)}\nAnswer:"


def openqa_user_text(record: OpenQARecord) -> str:
    """A short-answer prompt; the format is the same for training and evaluation."""
    return f"{OPENQA_INSTRUCTION}\n\nQuestion: {record.question}"
