"""The one training loop and what it reads, the base and drafter trainers, the artifact cache."""
