"""Small, algorithm-agnostic helpers shared by the scripts in algorithms/."""
