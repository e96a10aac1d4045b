-- The llama-cpp-python release (which pins the llama.cpp it builds) a model fell back to safe
-- mode under (LMSP §11): after an update the crash may be fixed, so a decision made under
-- another release no longer applies and fast mode is tried again. Decisions from before this
-- column have none: they are tried again too, once (some were a request's grammar crashing,
-- not the CPU kernels).
ALTER TABLE engine_modes ADD COLUMN llama TEXT;
