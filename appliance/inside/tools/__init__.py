"""The model tools' parts (llama.cpp, whisper.cpp, the catalogue); jailed code imports their
public face, `appliance.tools`."""
