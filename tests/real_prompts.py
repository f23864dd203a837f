"""The prompts of the real-model tests: each is used raw and through the chat template."""

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
    "List three colours of the rainbow.",
    "Once upon a time, in a small village by the mountains,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate 'good morning' into Spanish.",
    "The three laws of thermodynamics are",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "In 1969, 2 astronauts walked on the Moon; the year after that was",
    "Summarise: The cat sat on the mat. It was warm. Then it slept for 3 hours.",
)

#: The chat conversations of the tokenizer tests (system prompts, several turns, special tokens).
CONVERSATIONS = (
    [{"role": "user", "content": PROMPTS[0]}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3? <|im_end|> is a special token."}],
)
