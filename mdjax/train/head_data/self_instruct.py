"""Growing a prompt set self-instruct style: the model writes the user requests.

Seeds written for mdjax (no quoted data set): task kinds, each with instructions that
ask the model for one user request (or a passage) about a topic, and topics per
domain. Each (kind, instruction, topic) is one ask; the model's answer, cleaned
(`clean`), becomes a prompt, directly or wrapped in the kind's task::

    ask     "Write one question a student might ask about {topic}. Write only the question."
            topic = "volcanoes"
    model   "Question: Why do some volcanoes erupt explosively while others do not?"
    prompt  "Why do some volcanoes erupt explosively while others do not?"        (stem)

    ask     "Write a short paragraph of three or four sentences about {topic}."
    model   "Bees live in colonies ... "
    prompt  "Summarise this passage in one sentence:\\n\\nBees live in colonies ..."  (summary)

Then `keep` drops what is too short or long, not English, a refusal or garbage
(repeated phrases, template tokens, the instruction echoed back), and `Deduper` drops
exact duplicates of the normalised text and near-duplicates (Jaccard similarity of
word 3-gram shingles at or above a threshold).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import unicodedata
from typing import Sequence

import numpy as np
from tqdm import tqdm

from mdjax.chat import chat_ids
from mdjax.models.model import Model
from mdjax.prompts import eos_ids
from mdjax.sampling import SamplingParams
from mdjax.train.head_data.capture import CaptureOptions, capture

ONLY = " Write only the {}, nothing else."
MAX_ASKS_PER_PROMPT = 10  # a model that writes no usable request still stops

# kind: ((instruction, topic domain), ...); {} is the topic
ASKS = {
    "chat": (("Write a short, friendly message that someone might send to a helpful assistant "
              "about {}." + ONLY.format("message"), "everyday"),
             ("Write a casual question a person might ask a chatbot about {}." +
              ONLY.format("question"), "everyday")),
    "qa": (("Write one factual question about {} that can be answered in a few sentences." +
            ONLY.format("question"), "everyday"),),
    "math": (("Write a short math word problem about {} that uses small numbers." +
              ONLY.format("problem"), "everyday"),
             ("Write a simple arithmetic or percentage question involving {}." +
              ONLY.format("question"), "everyday")),
    "code": (("Write a request asking for a small Python function that {}." +
              ONLY.format("request"), "code_tasks"),
             ("Write a question a beginner programmer might ask about {}." +
              ONLY.format("question"), "code_ideas")),
    "writing": (("Write an instruction asking for a short poem, story or letter about {}." +
                 ONLY.format("instruction"), "everyday"),
                ("Write a request for help writing something about {}." +
                 ONLY.format("request"), "everyday")),
    "roleplay": (("Write a question that someone might ask {}." + ONLY.format("question"),
                  "roles"),),
    "reasoning": (("Write a short puzzle or a question about {} that needs careful step by step "
                   "thinking." + ONLY.format("question"), "everyday"),),
    "stem": (("Write one question a student might ask about {}." + ONLY.format("question"),
              "stem"),
             ("Write a request to explain {} simply." + ONLY.format("request"), "stem")),
    "humanities": (("Write one question about {} that a curious reader might ask." +
                    ONLY.format("question"), "humanities"),),
    "translation": (("Write one simple English sentence about {}." + ONLY.format("sentence"),
                     "everyday"),),
    "summary": (("Write a short paragraph of three or four sentences about {}.", "passages"),),
    "passage_qa": (("Write a short paragraph of three or four sentences about {}.", "passages"),),
    "extraction": (("Write a short news paragraph about {} that mentions names, places and "
                    "numbers.", "passages"),),
}

# How a kind's cleaned answer becomes the prompt ({} = the answer); absent: as it is.
WRAPS = {
    "translation": ("Translate into French: {}", "Translate into Spanish: {}",
                    "Translate into German: {}"),
    "summary": ("Summarise this passage in one sentence:\n\n{}",
                "Give the main point of the following text in a few words:\n\n{}"),
    "passage_qa": ("Read the passage and answer: what is it mainly about?\n\n{}",
                   "{}\n\nBased on the passage above, what is one important detail?",
                   "{}\n\nWhat question does this passage answer? Explain briefly."),
    "extraction": ("List every name, place and number in this text:\n\n{}",
                   "Extract the key facts from this text as a short bullet list:\n\n{}"),
    "roleplay": ("Pretend you are {role}. {}",),
}

TOPICS = {
    "everyday": (
        "cooking pasta", "a birthday party", "saving money", "a train journey", "gardening",
        "keeping fit", "a rainy weekend", "pets", "moving house", "a job interview", "coffee",
        "learning a language", "a football match", "shopping for shoes", "a road trip", "sleep",
        "a school project", "recycling", "a camping trip", "baking bread", "a wedding",
        "public transport", "a new phone", "the weather", "a museum visit", "time management",
        "a library", "buying a car", "a picnic", "music lessons", "a hospital visit",
        "a farmers market", "video games", "a summer holiday", "friendship", "a garage sale",
        "making tea", "a marathon", "painting a room", "a lost wallet", "a city park",
        "a restaurant bill", "a bike repair", "a chess club", "a snowstorm", "house plants"),
    "code_tasks": (
        "sorts a list of names", "counts words in a file", "checks if a year is a leap year",
        "converts kilometres to miles", "finds duplicate numbers", "reverses the words in a "
        "sentence", "reads a JSON file", "validates a phone number", "computes a running "
        "average", "merges two dictionaries", "finds the median of a list",
        "generates a random password", "removes vowels from a string"),
    "code_ideas": (
        "lists and tuples", "for loops", "recursion", "exceptions", "classes and objects",
        "dictionaries", "string formatting", "list comprehensions", "reading a CSV file",
        "unit tests", "git branches", "variables and types"),
    "roles": (
        "a pirate captain", "a friendly librarian", "a medieval knight", "a travel guide in "
        "Rome", "a chef in a busy kitchen", "a detective", "an astronaut on the space station",
        "a park ranger", "a personal trainer", "a history teacher", "a shopkeeper in a small "
        "village", "a wise old wizard", "a museum curator", "a ship's navigator"),
    "stem": (
        "photosynthesis", "black holes", "electric circuits", "the periodic table", "volcanoes",
        "DNA", "gravity", "vaccines", "climate change", "prime numbers", "magnetism",
        "the water cycle", "plate tectonics", "chemical reactions", "the human heart",
        "sound waves", "probability", "solar panels", "bacteria", "the speed of light",
        "fractions", "the solar system", "evolution", "batteries", "earthquakes",
        "the immune system", "geometry", "nuclear energy", "rainbows", "algorithms"),
    "humanities": (
        "the Roman Empire", "ancient Egypt", "the printing press", "the Renaissance",
        "Shakespeare's plays", "the French Revolution", "democracy", "world religions",
        "the Silk Road", "impressionist painting", "Greek myths", "the Industrial Revolution",
        "human rights", "folk music", "the history of writing", "the Olympic Games",
        "famous explorers", "philosophy of happiness", "the Cold War", "classical music",
        "architecture of cathedrals", "the history of money", "fairy tales", "the Vikings"),
    "passages": (
        "a new bridge opening in a town", "a local football team winning a cup",
        "a scientist discovering a new species of frog", "a school starting a garden",
        "a storm closing roads", "a small bakery that became famous", "honeybees",
        "a village festival", "a museum buying a painting", "a company launching an electric "
        "bus", "a library lending tools", "a marathon in the rain", "a volunteer clean-up of a "
        "beach", "a city adding bike lanes", "a rescued dog finding a home", "the history of "
        "the bicycle", "a young chess champion", "a new train line", "a power cut in winter",
        "a farmer trying new crops", "a concert in the park", "a hospital opening a new wing"),
}

REFUSAL = re.compile(r"\b(i'?m sorry|i am sorry|i cannot|i can'?t|as an ai|language model|"
                     r"i'?m not able|i am not able|i'?m unable|i do not have|i don'?t have)\b",
                     re.IGNORECASE)
ECHO = re.compile(r"\b(write only|nothing else|write one|write a (short|casual|simple|request|"
                  r"question|math|puzzle))\b", re.IGNORECASE)
LABEL = re.compile(r"^\s*(?:\d+[.)]\s*|[-*]\s*)?(?:(?:question|message|request|problem|"
                   r"instruction|sentence|answer|paragraph)\s*\d*\s*:\s*)?", re.IGNORECASE)
QUOTED = re.compile(r'["“]([^"”]{12,})["”]?')
ASSISTANT_VOICE = re.compile(r"^(sure|certainly|of course|here'?s|here is|i'?m (ready|here|happy)|"
                             r"i am (ready|here|happy)|i'?d (love|be happy)|i just|i simply|"
                             r"one potential|as an? |a (user|chatbot|student) might)\b",
                             re.IGNORECASE)
STOPWORDS = frozenset(
    "a an the and or but if of to in on at for with from by about as is are was were be been "
    "do does did have has had can could will would should may might what which who whom whose "
    "when where why how this that these those it its i you he she we they my your our their "
    "me him her us them not no yes all some any many much more most one two there here than "
    "then so very just also into over after before".split())


@dataclasses.dataclass(frozen=True)
class Ask:
  """One request to the model: `text` (the instruction), and how to make a prompt of
  its answer."""

  kind: str
  text: str
  wrap: str  # "{}" = the answer as it is
  passage: bool  # the answer is a paragraph, not a one-line request


def asks(seed: int) -> list[Ask]:
  """Every (kind, instruction, topic), each with a wrap drawn by `seed`, in a seeded
  order that interleaves the kinds."""
  rng = np.random.default_rng(seed)
  made = []
  for kind, instructions in ASKS.items():
    wraps = WRAPS.get(kind, ("{}",))
    for instruction, domain in instructions:
      for topic in TOPICS[domain]:
        wrap = wraps[rng.integers(len(wraps))].replace("{role}", topic)
        made.append(Ask(kind=kind, text=instruction.format(topic), wrap=wrap,
                        passage=domain == "passages"))
  return [made[i] for i in rng.permutation(len(made))]


def clean(answer: str, passage: bool) -> str:
  """The model's answer as a request: its first non-empty line, without a leading
  label ("Question:", "1."); when it quotes something (`The student asks: "Why...?"`),
  the quoted text. A passage keeps every line, joined."""
  lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
  if not lines:
    return ""
  if passage:
    return " ".join(lines)
  text = LABEL.sub("", lines[0], count=1)
  quoted = QUOTED.search(text)
  return (quoted.group(1) if quoted else text).strip().strip('"“”\'').strip()


def keep(text: str, passage: bool) -> str | None:
  """Why `text` is dropped ("length", "language", "refusal", "not a request": the
  assistant's voice or a lead-in, "garbage"), or None to keep it. Requests have 4-80
  words, passages 25-200."""
  words = text.split()
  low, high = (25, 200) if passage else (4, 80)
  if not low <= len(words) <= high:
    return "length"
  letters = [c for c in text if c.isalpha()]
  lowered = [w.strip(".,;:!?\"'()").lower() for w in words]
  if (not letters or sum(c.isascii() for c in letters) < 0.97 * len(letters)
      or sum(w in STOPWORDS for w in lowered) < 0.1 * len(words)):
    return "language"
  if REFUSAL.search(text):
    return "refusal"
  if not passage and (ASSISTANT_VOICE.match(text) or text.endswith(":")):
    return "not a request"
  trigrams = list(zip(lowered, lowered[1:], lowered[2:]))
  if ("<|" in text or "http" in text or ECHO.search(text) or re.search(r"(.)\1{5,}", text)
      or (trigrams and max(trigrams.count(t) for t in set(trigrams)) >= 3)
      or len(letters) < 0.6 * len(text.replace(" ", ""))):
    return "garbage"
  return None


def normalise(text: str) -> str:
  """Lower case, NFKC, punctuation dropped, whitespace collapsed."""
  text = unicodedata.normalize("NFKC", text).lower()
  return " ".join(re.sub(r"[^\w\s]", " ", text).split())


class Deduper:
  """Keeps a text unless its normalised form was kept before, or its word 3-gram
  shingles have Jaccard similarity >= `threshold` with a kept text's (an inverted index
  over shingles finds the candidates)."""

  def __init__(self, threshold: float = 0.7):
    self.threshold = threshold
    self.seen: set[str] = set()
    self.shingles: list[frozenset] = []
    self.index: dict[tuple, list[int]] = {}

  def add(self, text: str) -> bool:
    """True, and remembered, when `text` is new."""
    key = normalise(text)
    words = key.split()
    shingles = frozenset(zip(words, words[1:], words[2:])) or frozenset([tuple(words)])
    if key in self.seen:
      return False
    shared: dict[int, int] = {}
    for shingle in shingles:
      for other in self.index.get(shingle, ()):
        shared[other] = shared.get(other, 0) + 1
    for other, count in shared.items():
      if count / len(shingles | self.shingles[other]) >= self.threshold:
        return False
    self.seen.add(key)
    for shingle in shingles:
      self.index.setdefault(shingle, []).append(len(self.shingles))
    self.shingles.append(shingles)
    return True


@dataclasses.dataclass
class Grown:
  """`grow`'s prompts ({"kind", "text"}) and what it dropped, by reason."""

  prompts: list[dict]
  dropped: collections.Counter
  asked: int = 0


def grow(model: Model, count: int, *, seed: int, batch: int, refill_rows: int, temperature: float,
         top_k: int, max_new_tokens: int = 96, known: Sequence[str] = (),
         progress: bool = True) -> Grown:
  """At least `count` new prompts the model writes from `asks(seed)` (cycled, each ask
  sampled again with new keys), kept by `keep` and new to a `Deduper` that already
  holds `known`; fewer when `MAX_ASKS_PER_PROMPT * count` asks did not give them."""
  made = asks(seed)
  ids = [chat_ids(model, ask.text) for ask in made]
  deduper = Deduper()
  for text in known:
    deduper.add(text)
  grown = Grown(prompts=[], dropped=collections.Counter())
  options = CaptureOptions(config=model.config, aux_layers=(), eos=eos_ids(model, None),
                           sampling=SamplingParams(temperature=temperature, top_k=top_k),
                           max_new_tokens=max_new_tokens)
  items = ((i, ids[i % len(made)]) for i in range(MAX_ASKS_PER_PROMPT * count))
  rows = capture(model, items, options, batch=batch, refill_rows=refill_rows, seed=seed,
                 max_prompt_tokens=max(map(len, ids)),
                 keep_going=lambda: len(grown.prompts) < count)
  with tqdm(total=count, disable=not progress, desc="growing prompts", dynamic_ncols=True) as bar:
    for row in rows:
      ask = made[row.item % len(made)]
      answer = model.tokenizer.decode(row.tokens[row.prompt_length:].tolist(),
                                      skip_special_tokens=True)
      text = clean(answer, ask.passage)
      reason = keep(text, ask.passage)
      prompt = ask.wrap.format(text)
      if reason is None and not deduper.add(prompt):
        reason = "duplicate"
      grown.asked += 1
      if reason:
        grown.dropped[reason] += 1
      else:
        grown.prompts.append({"kind": ask.kind, "text": prompt})
        bar.update()
  return grown
