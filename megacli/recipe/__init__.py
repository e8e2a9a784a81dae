"""Recipes: pydantic sections, one model per subcommand, YAML + --set loading."""
