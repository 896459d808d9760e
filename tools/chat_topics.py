"""Topics of the chat prompts the throughput benchmarks share."""

TOPICS = [
    "the history of the printing press",
    "how vaccines train the immune system",
    "why the sky is blue",
    "the rules of chess",
    "how a compiler works",
    "the water cycle",
    "black holes",
    "the French revolution",
    "photosynthesis",
    "how to bake bread",
    "the stock market",
    "plate tectonics",
    "the life of bees",
    "quantum computing",
    "the Roman empire",
    "how airplanes fly",
]
