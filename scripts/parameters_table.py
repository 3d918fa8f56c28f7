"""Print the auto policy's parameters, then its constants and the cost table's measurement
settings, as the two Markdown tables docs/parameters.md carries
(``autospec.policies.params.markdown_table``, ``constants_table``; tests/test_parameters.py
keeps them equal):

    .venv/bin/python scripts/parameters_table.py
"""

from autospec.policies.params import constants_table, markdown_table

if __name__ == "__main__":
    print(markdown_table())
    print(constants_table(), end="")
