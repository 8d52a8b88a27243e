"""Self-distilled training data: the model's own answers to a varied, built-in set of instructions.

This is how the I-DLM paper builds its data (the target model's regenerated answers): training the masks on
exactly the distribution they will be verified against maximises ISD acceptance. Nothing is downloaded: the
instructions are built from templates x topics below, and the answers come from the model itself through the
decoding engine, in batches. The result is a chat JSONL (OpenAI ``messages`` layout) that a user can reuse, or
replace with their own data (``dlm quickstart --data FILE``).

Training and held-out instructions use disjoint topic lists, so held-out measurements never see a training
prompt.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a few tips related to {t}.",
    "Describe the history of {t} in a few sentences.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize what someone should know about {t}.",
    "Tell me a short story that involves {t}.",
    "How would you teach a beginner about {t}?",
    "What is a common misconception about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Write a friendly email to a colleague about {t}.",
    "List the main steps to get started with {t}.",
    "What questions do people often ask about {t}?",
]

TRAIN_TOPICS = [
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "black holes",
    "the moon",
    "electricity",
    "magnets",
    "rainbows",
    "honey bees",
    "dinosaurs",
    "the human heart",
    "vaccines",
    "sleep",
    "drinking water",
    "healthy breakfast",
    "running",
    "yoga",
    "chess",
    "learning a new language",
    "reading books",
    "gardening",
    "baking bread",
    "making coffee",
    "saving money",
    "budgeting",
    "recycling",
    "climate change",
    "solar panels",
    "wind energy",
    "electric cars",
    "bicycles",
    "trains",
    "airplanes",
    "the internet",
    "email",
    "passwords",
    "computer programming",
    "Python",
    "databases",
    "spreadsheets",
    "artificial intelligence",
    "robots",
    "smartphones",
    "video games",
    "music lessons",
    "the piano",
    "painting",
    "photography",
    "museums",
    "the Roman Empire",
    "ancient Egypt",
    "the printing press",
    "maps",
    "the ocean",
    "coral reefs",
    "whales",
    "penguins",
    "cats",
    "dogs",
    "forests",
    "deserts",
    "mountains",
    "rivers",
    "weather forecasts",
    "clouds",
    "snow",
    "time management",
    "job interviews",
    "public speaking",
    "teamwork",
    "friendship",
    "kindness",
    "writing a resume",
    "cooking pasta",
    "vegetables",
    "fruit",
    "tea",
    "chocolate",
    "soccer",
    "basketball",
    "swimming",
    "camping",
    "traveling abroad",
    "libraries",
    "mathematics",
    "fractions",
    "geometry",
    "the solar system",
    "stars",
    "gravity",
    "sound",
    "light",
    "atoms",
    "chemistry",
    "microscopes",
]

HELDOUT_TOPICS = [
    "earthquakes",
    "tides",
    "butterflies",
    "the brain",
    "bread yeast",
    "hiking",
    "knitting",
    "origami",
    "the Great Wall of China",
    "submarines",
    "thunderstorms",
    "owls",
    "tomatoes",
    "the guitar",
    "poetry",
    "calendars",
    "bridges",
    "lighthouses",
    "the Olympics",
    "fireworks",
]

UNCONDITIONAL_PROMPTS = ["Once upon a time", "The", "In the", "Here is", "Today", "My favorite"]


def builtin_instructions(split: str = "train", n: int | None = None, seed: int = 0) -> list[str]:
    """Instructions from templates x topics; ``split`` is ``train`` or ``heldout`` (disjoint topics)."""
    topics = {"train": TRAIN_TOPICS, "heldout": HELDOUT_TOPICS}[split]
    items = [tpl.format(t=topic) for topic in topics for tpl in TEMPLATES]
    random.Random(seed).shuffle(items)
    return items if n is None else items[:n]


def chat_record(instruction: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": instruction}, {"role": "assistant", "content": answer}]}


def chat_prompt_ids(tokenizer, instruction: str) -> list[int]:
    """The token ids of ``instruction`` as one user turn in the tokenizer's chat template, ready for the
    assistant's answer (how self-distillation and the quickstart's measurements prompt the model)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def self_distill(
    generate_fn: Callable[[list[str]], list[str]],
    instructions: Iterable[str],
    out_path: str | os.PathLike,
    batch_size: int = 16,
    progress: bool = True,
) -> Path:
    """Write ``out_path`` (chat JSONL) with ``generate_fn``'s answers to ``instructions``, in batches.

    Resumable: finished records are appended to ``out_path + '.partial'`` as they come; a rerun skips them, and
    the final file appears (atomic rename) only when every instruction has its answer.
    """
    from tqdm import tqdm

    out_path = Path(out_path)
    partial = out_path.with_name(out_path.name + ".partial")
    instructions = list(instructions)
    done: dict[str, str] = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line from a kill: drop it, it will be regenerated
            done[rec["messages"][0]["content"]] = rec["messages"][1]["content"]
    todo = [x for x in instructions if x not in done]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Rewrite the partial file with only whole records, then append.
    with open(partial, "w") as fh:
        for ins in instructions:
            if ins in done:
                fh.write(json.dumps(chat_record(ins, done[ins])) + "\n")
    bar = tqdm(
        total=len(instructions),
        initial=len(instructions) - len(todo),
        desc="self-distill",
        unit="answer",
        disable=not progress,
    )
    with open(partial, "a") as fh:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            answers = generate_fn(chunk)
            for ins, ans in zip(chunk, answers):
                done[ins] = ans
                fh.write(json.dumps(chat_record(ins, ans)) + "\n")
            fh.flush()
            bar.update(len(chunk))
    bar.close()
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w") as fh:
        for ins in instructions:
            fh.write(json.dumps(chat_record(ins, done[ins])) + "\n")
    os.replace(tmp, out_path)
    partial.unlink(missing_ok=True)
    return out_path
