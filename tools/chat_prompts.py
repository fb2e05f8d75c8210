"""Chat prompts written from topic lists: the training ones for self-distillation (``tools.chat_data``)
and held-out ones on topics that no training prompt names, for tau on chat the head never saw."""

from __future__ import annotations

import random

TRAINING_TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "earthquakes", "the immune system",
    "vaccines", "the human heart", "sleep", "dreams", "memory", "habits", "exercise", "nutrition", "vitamins",
    "coffee", "tea", "chocolate", "bread baking", "fermentation", "composting", "gardening", "houseplants",
    "bees", "ants", "whales", "dolphins", "octopuses", "penguins", "elephants", "wolves", "cats", "dogs",
    "horses", "birds migrating", "coral reefs", "rainforests", "deserts", "glaciers", "the ocean tides",
    "the moon", "Mars", "Jupiter", "the sun", "stars", "galaxies", "gravity", "magnetism", "electricity",
    "light", "sound", "rainbows", "lightning", "clouds", "wind", "weather forecasts", "climate change",
    "renewable energy", "solar panels", "wind turbines", "batteries", "electric cars", "bicycles", "trains",
    "airplanes", "rockets", "satellites", "the internet", "email", "passwords", "encryption", "computers",
    "programming", "Python", "algorithms", "databases", "spreadsheets", "smartphones", "social media",
    "video games", "chess", "football", "basketball", "tennis", "swimming", "running a marathon", "yoga",
    "meditation", "music", "the piano", "the guitar", "painting", "photography", "poetry", "novels",
    "libraries", "museums", "the printing press", "ancient Egypt", "ancient Rome", "ancient Greece",
    "the Middle Ages", "the Renaissance", "the industrial revolution", "castles", "pyramids", "maps",
    "compasses", "clocks", "calendars", "money", "banks", "saving money", "budgeting", "taxes", "inflation",
    "supply and demand", "small businesses", "job interviews", "writing a resume", "public speaking",
    "teamwork", "leadership", "time management", "learning a language", "studying for exams", "homework",
    "friendship", "kindness", "patience", "honesty", "recycling", "plastic pollution", "clean water",
    "cooking rice", "making soup", "pizza", "pasta", "salads", "breakfast", "camping", "hiking", "fishing",
    "travel packing", "airports", "hotels", "cities", "villages", "bridges", "skyscrapers", "roads",
    "traffic lights", "fire safety", "first aid", "colds and flu", "drinking water", "washing hands",
)

# Topics no training prompt names: what ``dovetail-train eval --chat`` measures tau on.
HELDOUT_TOPICS = (
    "the Great Wall of China", "submarines", "lighthouses", "tornadoes", "snowflakes", "butterflies",
    "sharks", "owls", "mushrooms", "cheese making", "knitting", "origami", "jazz", "opera", "the violin",
    "sculpture", "theatre", "robots", "3D printing", "nuclear power", "earth's core", "comets", "fossils",
    "dinosaurs", "the Olympic Games", "volunteering", "moving to a new city", "learning to drive",
)

TEMPLATES = (
    "Explain {topic} to a ten-year-old.",
    "What is the most interesting fact about {topic}?",
    "Write a short paragraph about {topic}.",
    "Give me three tips related to {topic}.",
    "Why is {topic} important?",
    "Describe {topic} in simple words.",
    "Write a short poem about {topic}.",
    "What are the main benefits and drawbacks of {topic}?",
    "How would you teach a friend about {topic}?",
    "Summarize what people should know about {topic} in two sentences.",
    "Write a short story that involves {topic}.",
    "List five words that come to mind when you think of {topic}, and explain each.",
    "What questions do scientists still ask about {topic}?",
    "Tell me a fun fact about {topic}.",
    "How has {topic} changed over the last hundred years?",
    "Write an encouraging message for someone who is interested in {topic}.",
    "What is a common misconception about {topic}?",
    "Compare {topic} with something from everyday life.",
    "Can you give me a step-by-step introduction to {topic}?",
    "Write a short dialogue between two friends talking about {topic}.",
    "What would a beginner need to get started with {topic}?",
    "How does {topic} affect our daily lives?",
    "Write a product description for a book about {topic}.",
    "Give me a quiz with three questions about {topic}.",
)


def _prompts(topics: tuple[str, ...]) -> list[str]:
    return [template.format(topic=topic) for topic in topics for template in TEMPLATES]


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct training prompts in a seeded random order (all of them when fewer exist)."""
    prompts = _prompts(TRAINING_TOPICS)
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def heldout_prompts(count: int = 24, seed: int = 0) -> list[str]:
    """``count`` prompts on the held-out topics, one template each in turn (seeded)."""
    rng = random.Random(seed)
    topics = list(HELDOUT_TOPICS)
    rng.shuffle(topics)
    return [TEMPLATES[index % len(TEMPLATES)].format(topic=topic) for index, topic in enumerate(topics[:count])]
