"""The translation lab: attention from first principles (``primer``), a generated English-German
corpus (``corpus``) and a toy translator trained on it (``translator``). Its decoding is stepped
through by the step debugger every encoder-decoder shares (:mod:`attnscope.capture.decode`) and
drawn by the step view (:mod:`attnscope.present.steps`)."""
