"""The prompts the speed benchmarks that compare two runs send (bench/serve_concurrent.py,
bench/before_after.py): short, varied, the same in both."""

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Write a haiku about rain.",
    "The best way to learn Python is",
    "My favourite animal is",
    "In 1969, the first",
    "A good breakfast has",
    "The ocean is",
    "How do plants grow?",
    "The meaning of life is",
    "Tell me about the moon.",
    "Coffee or tea?",
    "The weather today is",
    "A short story about a cat:",
    "List three colours:",
    "Why is the sky blue?",
]
