"""The bottom layer: argument checks, non-finite guards and precision facts (numerics), and trimmed
drafter vocabularies (vocab). Imports nothing from the project, so every other module may use it."""
