"""Print the auto policy's parameters as the Markdown table docs/parameters.md carries
(``autospec.policies.params.markdown_table``; tests/test_parameters.py keeps the two equal):

    .venv/bin/python scripts/parameters_table.py
"""

from autospec.policies.params import markdown_table

if __name__ == "__main__":
    print(markdown_table(), end="")
