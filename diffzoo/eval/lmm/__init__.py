"""The VLM benchmarks of the papers (POPE, MME, ScienceQA-IMG, TextVQA, GQA, OK-VQA): official scoring (`metrics`)."""
