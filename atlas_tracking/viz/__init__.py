"""What an operator reads: console tables, figures and the self-contained HTML report."""
