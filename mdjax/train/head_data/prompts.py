"""Prompts for training heads by self-distillation, and reading the user's own.

The heads learn what the model writes, so the prompts only have to make it write the
kinds of text it will be asked for: explanations, lists, stories, emails, poems,
comparisons, summaries, factual answers, code, advice. `builtin_prompts` builds ~450
such instructions from the templates and topics below (written for mdjax, no quoted
text), always in the same order; `split_prompts` holds a seeded tenth out, by
prompt, so no held-out prompt's answer is ever trained on.

A prompts file (`read_prompts`) holds one prompt per line, or, when it ends in
`.jsonl`, one JSON value per line: a string, `{"prompt": string}`, or a list of token
ids (for models without a tokenizer). A plain text file (`read_text`) is training data
as it is: no prompt, no generation.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np

from mdjax.errors import MdjaxError

Prompt = str | list[int]

EXPLAIN = ("Explain {} to a ten-year-old.", "Explain {} in a short paragraph.",
           "What are the main ideas behind {}? Answer briefly.")
EXPLAIN_TOPICS = (
    "photosynthesis", "rainbows", "compound interest", "the water cycle", "vaccines", "tides",
    "a refrigerator", "a bicycle's gears", "the immune system", "inflation", "black holes",
    "earthquakes", "a compiler", "public-key encryption", "the seasons", "a heat pump",
    "supply and demand", "the greenhouse effect", "DNA", "a search engine", "electric motors",
    "the stock market", "recycling", "clouds", "a solar panel", "the moon's phases",
    "beekeeping", "sound waves", "a hash table", "democracy", "a neural network",
    "magnets", "volcanoes", "the printing press", "how airplanes fly", "fermentation",
    "a credit score", "sleep", "coral reefs", "binary numbers")
LISTS = ("List five {}.", "Give me a short list of {}, one line each.")
LIST_TOPICS = (
    "ways to save water at home", "healthy breakfast ideas", "tips for a job interview",
    "board games for a family evening", "things to pack for a weekend hike",
    "ways to reduce stress", "common mistakes new programmers make", "uses for baking soda",
    "questions to ask a landlord", "houseplants that are easy to keep alive",
    "ways to learn a new language", "reasons to keep a journal", "cheap hobbies",
    "safety rules for a kitchen", "ways to make a small room look bigger",
    "habits of good writers", "things to check before buying a used car",
    "fruits that are high in vitamin C", "ideas for a rainy afternoon",
    "ways to be more productive in the morning", "features of a good password",
    "animals that live in the desert", "steps to plant a tree", "signs of a healthy lawn",
    "ideas for a birthday party", "ways to cut down on plastic", "easy dinner recipes",
    "things to do in a new city", "skills every cook should learn",
    "ways to keep a dog entertained")
STORY = ("Write a short story about {}.", "Tell a very short bedtime story about {}.")
STORY_TOPICS = (
    "a robot who learns to paint", "a lost key that opens a secret door",
    "a lighthouse keeper and a storm", "a cat who runs a bakery", "the last tree in a city",
    "a girl who can talk to rivers", "a dragon afraid of heights", "two friends building a raft",
    "a clock that runs backwards", "a village where it never rains",
    "an astronaut who misses the sea", "a library that is open only at night",
    "a fox who collects buttons", "a train that goes to the moon", "a small boat on a big ocean",
    "a snowman in summer", "a detective who is a parrot", "a garden that grows music",
    "an old map found in an attic", "a kite that wanted to be a bird")
EMAIL = "Write a short email {}."
EMAIL_TOPICS = (
    "asking a colleague for feedback on a report", "inviting neighbours to a street party",
    "thanking a teacher at the end of the year", "asking for a day off next Friday",
    "apologising for missing a meeting", "welcoming a new member to the team",
    "asking a shop for a refund on a broken kettle", "confirming a dentist appointment",
    "telling a friend you will be late", "requesting a quote for painting a house",
    "reminding a club about its monthly fee", "proposing a new time for a call",
    "congratulating a friend on a new job", "asking a landlord to fix the heating",
    "announcing an office move", "following up on a job application",
    "inviting a speaker to a school event", "asking a neighbour to water the plants",
    "declining an invitation politely", "sharing the notes from a team meeting")
POEM = ("Write a short poem about {}.", "Write a haiku about {}.")
POEM_TOPICS = (
    "autumn leaves", "the sea at night", "a city waking up", "an old friend", "rain on a window",
    "the first snow", "a cup of tea", "mountains", "a long train journey", "the stars",
    "a summer garden", "a quiet library", "the wind", "a candle", "morning coffee",
    "a river in spring", "an empty beach", "the moon", "a busy market", "a thunderstorm")
COMPARE = "Compare {} and {}: how are they alike and how do they differ?"
COMPARE_PAIRS = (
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("Python", "JavaScript"),
    ("renting", "buying a home"), ("solar power", "wind power"), ("books", "films"),
    ("running", "swimming"), ("email", "instant messaging"), ("cities", "the countryside"),
    ("a laptop", "a tablet"), ("summer", "winter"), ("democracy", "monarchy"),
    ("lists", "tuples in Python"), ("viruses", "bacteria"), ("weather", "climate"),
    ("a debit card", "a credit card"), ("SQL", "NoSQL databases"), ("rivers", "lakes"),
    ("mammals", "reptiles"), ("stocks", "bonds"), ("baking", "frying"),
    ("paper books", "e-readers"), ("working from home", "working in an office"),
    ("electric cars", "petrol cars"))
SUMMARY = ("Summarise this passage in one sentence:\n\n{}",
           "Give the main point of the following text in a few words:\n\n{}")
PASSAGES = (
    "The town council met on Tuesday to discuss the new bus routes. Residents complained that "
    "the late-night service had been cut, and the council agreed to run two extra buses on "
    "weekends while it studies how many people travel after ten o'clock.",
    "Mara had practised the piano every evening for a year. On the night of the concert her "
    "hands shook, but once she played the first chord the fear faded, and she finished to a "
    "long round of applause from the small audience.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. "
    "The angle of the dance shows the direction relative to the sun, and its length tells "
    "the other bees how far they need to fly.",
    "The company's profits rose this quarter because it sold more of its cheaper phones in "
    "new markets. Its expensive models sold fewer units than last year, and managers expect "
    "that trend to continue.",
    "A new study followed two thousand adults for ten years and found that those who walked "
    "for thirty minutes a day had fewer heart problems, even when they did no other exercise.",
    "The bridge, closed since the spring floods, reopened this morning. Engineers replaced two "
    "of its supports and added sensors that will warn the city if the river rises too fast.",
    "Tom wanted to surprise his sister with a cake, but he forgot the sugar. She tasted it, "
    "laughed, and said it was the best bread she had ever eaten.",
    "Libraries today lend far more than books. Many offer laptops, museum passes, tools and "
    "even seeds, and their rooms are used for classes, clubs and job interviews.",
    "Octopuses have three hearts and blue blood. Two hearts move blood through the gills, and "
    "the third pumps it through the rest of the body.",
    "The school replaced its old heating system with heat pumps over the summer. The head "
    "teacher said the classrooms were warmer and the energy bill had fallen by a third.",
    "Early sailors found their way using the stars. By measuring the angle of a known star "
    "above the horizon, they could work out how far north or south they were.",
    "The museum's new exhibition shows everyday objects from a hundred years ago, including "
    "toys, kitchen tools and letters, to show how ordinary life has changed.",
    "After the storm, volunteers from the village cleared fallen branches from the roads and "
    "checked on older neighbours, and by evening every house had its power back.",
    "Learning to code is less about memorising syntax than about breaking problems into small "
    "steps. Beginners who practise that habit tend to make faster progress.",
    "The orchard had its best harvest in years. A mild spring meant fewer frosts, and the "
    "farmers hired extra pickers to bring in the apples before the rain.")
QUESTIONS = (
    "What is the capital of Japan?", "Why is the sky blue?", "How many legs does a spider have?",
    "What is the boiling point of water at sea level?", "Who invented the telephone?",
    "What causes thunder?", "How far is the Moon from the Earth?",
    "What is the largest ocean on Earth?", "Why do leaves change colour in autumn?",
    "What is the difference between a meteor and a meteorite?", "How do fish breathe?",
    "What is the speed of light?", "Which planet is known as the red planet?",
    "What language is spoken in Brazil?", "Why do we have leap years?",
    "What is the tallest mountain in the world?", "How many bones are in the human body?",
    "What does a thermometer measure?", "What is the chemical symbol for gold?",
    "How long does it take the Earth to orbit the Sun?", "Why does ice float on water?",
    "What is the main gas in the air we breathe?", "Who wrote the first computer program?",
    "What is the smallest prime number?", "What do pandas eat?",
    "How does a rainbow form?", "What is the freezing point of water in Fahrenheit?",
    "Why do cats purr?", "What is a light year?", "How many continents are there?",
    "What is the largest animal that has ever lived?", "Why is the ocean salty?",
    "What is the square root of 144?", "How do plants get water?",
    "What is the longest river in Africa?", "What is an atom made of?",
    "Why do we see lightning before we hear thunder?", "What is the hottest planet?",
    "What does the heart do?", "How many minutes are there in a day?")
CODE = "Write a Python function that {}."
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "finds the largest number in a list",
    "removes duplicates from a list while keeping the order",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "merges two sorted lists",
    "returns the most common word in a text", "computes the factorial of a number",
    "flattens a list of lists", "checks whether two strings are anagrams",
    "sums the digits of an integer", "returns the second smallest number in a list",
    "splits a list into chunks of a given size", "counts how often each letter appears",
    "validates a simple email address", "rotates a list by k positions",
    "finds the common elements of two lists", "converts a Roman numeral to an integer",
    "computes the average of a list, ignoring None values", "capitalises every word in a sentence",
    "checks whether brackets in a string are balanced", "returns the prime factors of a number",
    "reads a CSV file and returns its rows as dictionaries", "binary searches a sorted list",
    "returns the running total of a list", "finds the longest word in a sentence",
    "transposes a matrix given as a list of lists")
CODE_OTHER = (
    "Explain what this Python code does:\n\nfor i in range(1, 4):\n    print(i * i)",
    "Explain what this Python code does:\n\nwords = text.split()\nprint(len(set(words)))",
    "Find the bug in this function:\n\ndef mean(xs):\n    return sum(xs) / len(xs) + 1",
    "What is the difference between a list and a dictionary in Python?",
    "How do I read a text file line by line in Python?",
    "Write a SQL query that counts the orders of each customer.",
    "Explain recursion with a small example in Python.",
    "What does the git command 'git status' show?",
    "Write a shell command that counts the lines of every .txt file in a folder.",
    "Explain what a unit test is and write one small example in Python.")
ADVICE = ("Give me some advice on {}.", "What should a beginner know about {}?")
ADVICE_TOPICS = (
    "starting to run", "keeping a vegetable garden", "saving money each month", "public speaking",
    "learning to cook", "studying for exams", "taking better photos", "moving to a new city",
    "learning to play the guitar", "writing a CV", "keeping a tidy desk", "drinking more water",
    "managing time at work", "starting a blog", "caring for a new puppy",
    "planning a road trip", "learning to swim as an adult", "reading more books",
    "making friends in a new town", "sleeping better")


def _fill(templates: tuple[str, ...], topics) -> list[str]:
  """Every topic with every template, topic-major."""
  return [template.format(*topic) if isinstance(topic, tuple) else template.format(topic)
          for topic in topics for template in templates]


def builtin_prompts() -> list[str]:
  """The built-in instructions (~450, distinct), in a fixed order."""
  prompts = (_fill(EXPLAIN, EXPLAIN_TOPICS) + _fill(LISTS, LIST_TOPICS) +
             _fill(STORY, STORY_TOPICS) + _fill((EMAIL,), EMAIL_TOPICS) +
             _fill(POEM, POEM_TOPICS) + _fill((COMPARE,), COMPARE_PAIRS) +
             _fill(SUMMARY, PASSAGES) + list(QUESTIONS) + _fill((CODE,), CODE_TASKS) +
             list(CODE_OTHER) + _fill(ADVICE, ADVICE_TOPICS))
  return list(dict.fromkeys(prompts))


def split_prompts(prompts: list[Prompt], heldout_fraction: float,
                  seed: int) -> tuple[list[Prompt], list[Prompt]]:
  """(train, held-out): `ceil(fraction * n)` prompts drawn by `seed` are held out (at least
  one, never all); both keep the prompts' order."""
  if len(prompts) < 2:
    raise MdjaxError(f"need at least 2 prompts (or text rows) to hold some out, got {len(prompts)}")
  count = min(len(prompts) - 1, max(1, math.ceil(heldout_fraction * len(prompts))))
  heldout = set(np.random.default_rng(seed).permutation(len(prompts))[:count].tolist())
  return ([p for i, p in enumerate(prompts) if i not in heldout],
          [p for i, p in enumerate(prompts) if i in heldout])


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
  """The prompts of a file: one per non-empty line, or one JSON value per line in a
  `.jsonl` file (a string, {"prompt": string} or a list of token ids)."""
  path = pathlib.Path(path)
  lines = [line for line in _read(path).splitlines() if line.strip()]
  prompts = [_json_prompt(path, i, line) for i, line in enumerate(lines, 1)
             ] if path.suffix == ".jsonl" else lines
  if not prompts:
    raise MdjaxError(f"the prompts file {str(path)!r} holds no prompts")
  return prompts


def read_text(path: str | os.PathLike) -> str:
  """A plain text file's contents (training data as it is), never empty."""
  text = _read(pathlib.Path(path))
  if not text.strip():
    raise MdjaxError(f"the text file {str(path)!r} is empty")
  return text


def _read(path: pathlib.Path) -> str:
  if not path.is_file():
    raise MdjaxError(f"no such file: {str(path)!r}")
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise MdjaxError(f"{str(path)!r} is not UTF-8 text ({e})") from None


def _json_prompt(path: pathlib.Path, number: int, line: str) -> Prompt:
  """Line `number` of a JSONL prompts file as a prompt."""
  try:
    value = json.loads(line)
  except json.JSONDecodeError as e:
    raise MdjaxError(f"{str(path)!r} line {number} is not JSON ({e})") from None
  if isinstance(value, dict):
    value = value.get("prompt")
  if isinstance(value, str) and value.strip():
    return value
  if (isinstance(value, list) and value and
      all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
    return value
  raise MdjaxError(f"{str(path)!r} line {number} must be a non-empty string, "
                   f'{{"prompt": string}} or a list of token ids, got {line.strip()[:80]!r}')
