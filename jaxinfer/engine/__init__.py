"""The engine: requests in (input_processor), one scheduled step at a time (llm_engine),
outputs out (output_builder, detokenizer); its rooms are scheduling, execution, sampling,
speculation and startup; lockstep runs it on several processes."""
