"""``rayzero.deepspeed.utils``: DeepSpeed's ``deepspeed.utils`` helpers that scripts import (``zero_to_fp32``)."""
