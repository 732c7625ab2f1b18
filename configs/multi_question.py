"""The main job: several questions over one passage, answered in parallel by a real
instruct model through its chat template, each answer exactly the one it would get
alone (checked, and timed against answering the questions one after another):
`python -m experiments.decode --config=configs/multi_question.py`.

Override with a tuple, e.g. `--config.questions="('Who runs the ferry?', 'When?')"`;
`--config.chat=False` asks the raw passage + questions (e.g. of a base model)."""

from configs import common

PASSAGE = """Marrow Point is a small fishing town on a rocky cape. Its lighthouse was built \
in 1887 from grey granite and stands 41 metres tall. The light was kept by the Odell \
family for three generations until it was automated in 1979. Today the keeper's cottage \
is a museum that opens from May to September. A ferry to the nearby island of Tessel \
leaves the harbour twice a day, at 8 in the morning and at 5 in the afternoon, and the \
crossing takes forty minutes. Every August the town holds a festival of boats, when the \
harbour fills with sailing ships decorated with lanterns."""

QUESTIONS = ("When was the lighthouse built?",
             "How tall is the lighthouse?",
             "Which family kept the light?",
             "In which months is the museum open?",
             "How long does the ferry crossing take?",
             "What happens every August?")


def get_config():
  """The shared fields with strategy "multi_question", SmolLM2-135M-Instruct, its chat
  template, and six questions over one passage."""
  config = common.get_base_config("multi_question")
  config.model = "smollm2-135m-instruct"
  config.prompt = "Read this text:\n" + PASSAGE
  config.questions = QUESTIONS
  config.chat = True
  config.question_separator = "\n\nAnswer in one sentence: "
  config.compare_sequential = True
  config.max_new_tokens = 40
  return config
